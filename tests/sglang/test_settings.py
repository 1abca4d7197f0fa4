"""The plugin's environment variables in one object (graphcap.sglang.settings): docs/sglang.md's table and the
object's fields name the same variables, every bad value is one error naming the variable, the value and what it
takes, and the process reads them once, again only where they change. The launcher's start-up check refusing each
bad value is tested against sglang's own ServerArgs in test_plugin.py. No sglang needed here."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from graphcap import envvars
from graphcap.sglang import settings as s
from graphcap.sglang.compat import DraftCaptureConfigError
from graphcap.sglang.settings import DraftCaptureOptions, PluginSettings

DOCS = Path(__file__).resolve().parents[2] / "docs" / "sglang.md"

# (variable, a bad value, what the error says it takes): every variable with a value the parse refuses. A directory
# is any string here: whether it can be created and written is the start-up check's (test_plugin.py).
BAD = [
    (s.DRAFT_CAPTURE_ENV, "{not json", r"not valid JSON"),
    (s.DRAFT_CAPTURE_ENV, '{"enabled": true, "backend": "fast"}', r"backend must be one of .*got 'fast'"),
    (s.DRAFT_CAPTURE_ENV, '{"enabeld": true}', r"expected a JSON object with keys enabled, backend"),
    (s.CHECK_ENV, "yes", r"expected 0 or 1, got 'yes'"),
    (s.CHECK_ENV, "true", r"expected 0 or 1, got 'true'"),
    (s.TRACE_FLUSH_ENV, "0", r"expected a whole number of draft calls >= 1, got '0'"),
    (s.TRACE_FLUSH_ENV, "1.5", r"expected a whole number of draft calls >= 1, got '1.5'"),
    (s.TRACE_FLUSH_ENV, "-3", r"expected a whole number of draft calls >= 1, got '-3'"),
    (s.TRACE_PROFILE_ENV, "8,x", r"expected batch sizes >= 1 separated by commas, got '8,x'"),
    (s.TRACE_PROFILE_ENV, "0", r"expected batch sizes >= 1 separated by commas, got '0'"),
    (s.TRACE_HOST_ENV, "0", r"expected a sampling period in milliseconds, 0.1 to 1000, got '0'"),
    (s.TRACE_HOST_ENV, "fast", r"expected a sampling period in milliseconds, 0.1 to 1000, got 'fast'"),
    (s.TRACE_HOST_ENV, "nan", r"expected a sampling period in milliseconds, 0.1 to 1000, got 'nan'"),
    (s.MANIFEST_FLUSH_ENV, "soon", r"expected seconds >= 0, got 'soon'"),
    (s.MANIFEST_FLUSH_ENV, "-1", r"expected seconds >= 0, got '-1'"),
    (s.MANIFEST_FLUSH_ENV, "nan", r"expected seconds >= 0, got 'nan'"),
    (s.ALLOW_UNTESTED_ENV, "2", r"expected 0 or 1, got '2'"),
    (envvars.KERNEL_PATHS_ENV, "sm70", r"expected one of native, sm80 \(unset: native\), got 'sm70'"),
    (s.COMPILE_SCOPE_ENV, "graph", r"expected iteration or model, got 'graph'"),
]

# (variable, a good value, the field's value)
GOOD = [
    (s.DRAFT_CAPTURE_ENV, '{"enabled": true, "projections": "sglang"}',
     DraftCaptureOptions(enabled=True, projections="sglang")),
    (s.CHECK_ENV, "1", True),
    (s.CHECK_ENV, "0", False),
    (s.TRACE_ENV, "/tmp/trace", "/tmp/trace"),
    (s.TRACE_FLUSH_ENV, "1", 1),
    (s.TRACE_PROFILE_ENV, "8, 64", (8, 64)),
    (s.TRACE_HOST_ENV, "2", 2.0),
    (s.TRACE_HOST_ENV, "0.5", 0.5),
    (s.MANIFEST_FLUSH_ENV, "0", 0.0),
    (s.MANIFEST_FLUSH_ENV, "2.5", 2.5),
    (envvars.MANIFEST_DIR_ENV, "~/m", Path("~/m").expanduser()),
    (s.ALLOW_UNTESTED_ENV, "1", True),
    (envvars.KERNEL_PATHS_ENV, " SM80 ", "sm80"),
    (envvars.KERNEL_PATHS_ENV, "native", "native"),
    (s.COMPILE_SCOPE_ENV, "model", "model"),
]


def documented_variables() -> list[str]:
    """The first column of docs/sglang.md's table under "Environment variables"."""
    text = DOCS.read_text()
    section = text.split("### Environment variables\n", 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [re.match(r"\| `(GRAPHCAP_[A-Z0-9_]+)", row).group(1) for row in rows]


def test_every_documented_variable_is_a_setting_and_every_setting_is_documented():
    documented = documented_variables()
    assert len(documented) == len(set(documented)), documented
    assert set(documented) == set(s.VARIABLES), (set(documented) ^ set(s.VARIABLES))
    assert sorted(s.VARIABLES.values()) == sorted(f for f in PluginSettings.__dataclass_fields__)


@pytest.mark.parametrize("name", sorted(s.VARIABLES))
def test_each_documented_row_says_what_the_start_up_check_checks(name):
    section = DOCS.read_text().split("### Environment variables\n", 1)[1]
    row = next(line for line in section.splitlines() if line.startswith(f"| `{name}"))
    assert len(row.split(" | ")) == 3 and row.split(" | ")[1].strip(), row  # variable | checked at start-up | meaning


@pytest.mark.parametrize("name, raw, expected", BAD, ids=[f"{n}={r}" for n, r, _ in BAD])
def test_a_bad_value_is_one_line_naming_the_variable_the_value_and_what_it_takes(name, raw, expected):
    with pytest.raises(DraftCaptureConfigError) as e:
        PluginSettings.from_env({name: raw})
    msg = str(e.value)
    assert msg.startswith(f"${name}: ") and "\n" not in msg, msg
    assert re.search(expected, msg), msg


@pytest.mark.parametrize("name, raw, want", GOOD, ids=[f"{n}={r}" for n, r, _ in GOOD])
def test_a_good_value_becomes_its_field(name, raw, want):
    got = PluginSettings.from_env({name: raw})
    assert getattr(got, s.VARIABLES[name]) == want
    others = {f: getattr(got, f) for f in s.VARIABLES.values() if f != s.VARIABLES[name]}
    assert others == {f: getattr(PluginSettings(), f) for f in others}  # nothing else moved


def test_unset_and_empty_are_the_documented_defaults():
    want = PluginSettings(draft_capture=DraftCaptureOptions(), check=False, trace_dir=None, trace_flush=16,
                          trace_profile=(), manifest_flush_s=10.0, manifest_dir=None, allow_untested=False,
                          kernel_paths="native", compile_scope="iteration")
    assert PluginSettings.from_env({}) == want == PluginSettings()
    assert PluginSettings.from_env({name: "" for name in s.VARIABLES}) == want
    assert PluginSettings.from_env({"GRAPHCAP_SGLANG_CHEK": "1", "PATH": "/bin"}) == want  # not ours: not read


def test_settings_are_frozen():
    with pytest.raises(AttributeError):
        PluginSettings().check = True


def test_the_process_reads_them_once_and_again_only_where_one_changed(monkeypatch):
    for name in s.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    first = s.plugin_settings()
    assert s.plugin_settings() is first  # not parsed again
    monkeypatch.setenv(s.CHECK_ENV, "1")
    second = s.plugin_settings()
    assert second.check and second is not first and s.plugin_settings() is second
    monkeypatch.setenv(s.TRACE_FLUSH_ENV, "x")
    for _ in range(2):  # a bad value is named at every read, not only the first
        with pytest.raises(DraftCaptureConfigError, match=r"^\$GRAPHCAP_SGLANG_TRACE_FLUSH: "):
            s.plugin_settings()
    monkeypatch.delenv(s.TRACE_FLUSH_ENV)
    assert s.plugin_settings() == second


def test_the_library_variables_are_parsed_in_one_place(monkeypatch, tmp_path):
    """graphcap.envvars parses GRAPHCAP_MANIFEST_DIR and GRAPHCAP_KERNEL_PATHS; the library reads them through it
    (the manifest's default directory here; the kernels' switch: test_sm80.py)."""
    from graphcap import manifest as mf

    monkeypatch.setenv(envvars.MANIFEST_DIR_ENV, str(tmp_path / "m"))
    assert mf.default_manifest_dir() == tmp_path / "m"
    assert envvars.manifest_dir({envvars.MANIFEST_DIR_ENV: str(tmp_path / "m")}) == tmp_path / "m"
    assert envvars.manifest_dir({envvars.MANIFEST_DIR_ENV: ""}) is None
    assert envvars.kernel_paths({}) == "native"
    with pytest.raises(ValueError, match=r"^\$GRAPHCAP_KERNEL_PATHS: expected one of native, sm80"):
        envvars.kernel_paths({envvars.KERNEL_PATHS_ENV: "a100"})
