"""graphcap's sglang plugin against the real sglang package (CPU): entry-point discovery by sglang's own
`load_plugins()`, the flags through sglang's own `prepare_server_args`, the value on ServerArgs across pickling (in
this process and in a fresh interpreter, as the scheduler subprocess gets it), start-up validation, and that without
the flag nothing is patched. Only sglang.srt.server_args / plugins are imported here (light); the deep runtime checks
run in a fresh interpreter (test_runtime.py). Runs against the sglang installed (0.5.23 in the venv) and, in a
subprocess, against sglang 0.5.18 (test_runtime.py): where the two resolve arguments differently the helpers
here ask the installed sglang's own functions."""
from __future__ import annotations

import json
import logging
import os
import pickle
import re
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from process_state import root_logger_kept
from sglang_required import require_sglang_plugin

require_sglang_plugin()
pytestmark = pytest.mark.sglang

from graphcap.sglang import compat, config, plugin  # noqa: E402  (after the skip)
from graphcap.envvars import KERNEL_PATHS_ENV, MANIFEST_DIR_ENV, PDL_ENV  # noqa: E402
from graphcap.sglang.settings import (ALLOW_UNTESTED_ENV, CHECK_ENV, COMPILE_SCOPE_ENV,  # noqa: E402
                                      DRAFT_CAPTURE_ENV, MANIFEST_FLUSH_ENV, PLUGIN_DEFAULT_BACKEND, TRACE_ENV,
                                      TRACE_FLUSH_ENV, TRACE_HOST_ENV, TRACE_PROFILE_ENV, VARIABLES,
                                      DraftCaptureOptions, plugin_settings)
from tiers import examples

ENABLED = ["--model-path", "dummy", "--speculative-algorithm", "NEXTN", "--enable-draft-graph-capture"]
# A child interpreter under sglang 0.5.18 needs what sglang_0518_pytest.py did for this one (_sglang_env.py).
CHILD_PRELUDE = ("import os\n"
                 "if os.environ.get('GRAPHCAP_TEST_SGLANG'):\n"
                 "    from _sglang_env import prepare_sglang_import\n"
                 "    prepare_sglang_import()\n")


@pytest.fixture
def fresh(monkeypatch):
    """sglang's plugin state as a fresh process has it; afterwards the patched ServerArgs methods, the plugin's
    variable (which parsing the flag exports) and the root logger (which sglang's parsing configures) restored."""
    from sglang.srt import plugins
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import ServerArgs

    saved = {n: ServerArgs.__dict__[n] for n in ("add_cli_args", "from_cli_args", "check_server_args")}
    for k in (DRAFT_CAPTURE_ENV, "SGLANG_PLUGINS"):
        monkeypatch.setenv(k, "")  # recorded as it was first, so that monkeypatch's undo ends with it
        monkeypatch.delenv(k)

    def clear():
        HookRegistry.reset()
        plugins._plugins_loaded = False
        plugin.STATE.runtime_hooks.clear()

    clear()
    with root_logger_kept():
        yield plugins
    for n, v in saved.items():
        setattr(ServerArgs, n, v)
    clear()


def _parse(argv):
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args(list(argv))


def _wrapped(cls, name) -> bool:
    raw = cls.__dict__[name]
    fn = getattr(raw, "__func__", raw)
    return hasattr(fn, "__wrapped__")


def test_entry_point_is_discovered_by_sglang_load_plugins(fresh):
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import ServerArgs

    before = plugin.STATE.registered
    fresh.load_plugins()
    assert plugin.STATE.registered == before + 1
    assert config.ADD_CLI_ARGS in HookRegistry._patched and config.FROM_CLI_ARGS in HookRegistry._patched
    assert _wrapped(ServerArgs, "add_cli_args") and _wrapped(ServerArgs, "from_cli_args")
    assert isinstance(ServerArgs.__dict__["from_cli_args"], classmethod)  # sglang kept the descriptor


def test_flag_parses_and_reaches_server_args(fresh, tmp_path):
    fresh.load_plugins()
    sa = _parse(ENABLED + ["--draft-graph-capture-backend", "cudagraph", "--draft-graph-manifest-dir", str(tmp_path)])
    want = DraftCaptureOptions(enabled=True, backend="cudagraph", manifest_dir=str(tmp_path))
    assert config.options_of(sa) == want
    assert sa.speculative_algorithm == "NEXTN"  # sglang's own fields untouched
    assert json.loads(os.environ[DRAFT_CAPTURE_ENV]) == json.loads(want.to_json())  # for the subprocesses' load_plugins
    copy = pickle.loads(pickle.dumps(sa))
    assert config.options_of(copy) == want


def test_projections_flag_parses_and_a_bad_value_is_named(fresh, monkeypatch):
    """--draft-graph-projections: graphcap's skinny GEMM by default, sglang's own kernels on request; a value outside
    the two is refused by sglang's parser (command line) or by name (the Engine path's JSON)."""
    fresh.load_plugins()
    assert config.options_of(_parse(ENABLED)).projections == "graphcap"
    sa = _parse(ENABLED + [config.PROJECTIONS_FLAG, "sglang"])
    assert config.options_of(sa) == DraftCaptureOptions(enabled=True, projections="sglang")
    assert json.loads(os.environ[DRAFT_CAPTURE_ENV])["projections"] == "sglang"
    with pytest.raises(SystemExit):
        _parse(ENABLED + [config.PROJECTIONS_FLAG, "cublas"])
    monkeypatch.setenv(DRAFT_CAPTURE_ENV, json.dumps({"enabled": True, "projections": "cublas"}))
    with pytest.raises(compat.DraftCaptureConfigError, match=r"projections must be one of graphcap, sglang, "
                                                             r"got 'cublas'"):
        plugin_settings()
    monkeypatch.setenv(DRAFT_CAPTURE_ENV, json.dumps({"enabled": True, "projection": "sglang"}))  # a misspelt key
    with pytest.raises(compat.DraftCaptureConfigError, match=r"keys enabled, backend, manifest_dir, projections"):
        plugin_settings()


def test_verify_attention_flag_parses_and_a_bad_value_is_named(fresh, monkeypatch):
    """--draft-graph-verify-attention: graphcap's split-KV verify kernel by default, sglang's extend kernel on
    request; a value outside the two is refused by sglang's parser (command line) or by name (the JSON)."""
    fresh.load_plugins()
    assert config.options_of(_parse(ENABLED)).verify_attention == "graphcap"
    sa = _parse(ENABLED + [config.VERIFY_ATTENTION_FLAG, "sglang"])
    assert config.options_of(sa) == DraftCaptureOptions(enabled=True, verify_attention="sglang")
    assert json.loads(os.environ[DRAFT_CAPTURE_ENV])["verify_attention"] == "sglang"
    with pytest.raises(SystemExit):
        _parse(ENABLED + [config.VERIFY_ATTENTION_FLAG, "flashinfer"])
    monkeypatch.setenv(DRAFT_CAPTURE_ENV, json.dumps({"enabled": True, "verify_attention": "flashinfer"}))
    with pytest.raises(compat.DraftCaptureConfigError, match=r"verify_attention must be one of graphcap, sglang, "
                                                             r"got 'flashinfer'"):
        plugin_settings()


def test_value_survives_pickling_into_a_fresh_interpreter(fresh, tmp_path):
    """What multiprocessing's spawn does for the scheduler: unpickle the ServerArgs in a new interpreter, whose
    environment is inherited, and whose own load_plugins() then installs the runtime hooks."""
    fresh.load_plugins()
    sa = _parse(ENABLED + ["--draft-graph-manifest-dir", str(tmp_path)])
    child = CHILD_PRELUDE + (
        "import pickle, sys, json\n"
        "sa = pickle.loads(sys.stdin.buffer.read())\n"
        "from graphcap.sglang import config\n"
        "from sglang.srt.plugins import load_plugins\n"
        "from sglang.srt.plugins.hook_registry import HookRegistry\n"
        "load_plugins()\n"
        "print(json.dumps({'opts': config.options_of(sa).to_json(), 'algo': sa.speculative_algorithm,\n"
        "                  'hooks': sorted(HookRegistry._patched)}))\n")
    r = subprocess.run([sys.executable, "-c", child], input=pickle.dumps(sa), capture_output=True, timeout=300,
                       env=dict(os.environ))
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    out = json.loads(r.stdout.decode().strip().splitlines()[-1])
    assert json.loads(out["opts"]) == {"enabled": True, "backend": PLUGIN_DEFAULT_BACKEND,
                                       "manifest_dir": str(tmp_path), "projections": "graphcap",
                                       "verify_attention": "graphcap"}
    assert out["algo"] == "NEXTN"
    # Not a scheduler process (sglang.srt.managers.scheduler not imported): only the start-up check is added.
    assert config.CHECK_SERVER_ARGS in out["hooks"]
    assert not set(config.WORKER_HOOKS) & set(out["hooks"])


def test_bad_backend_is_rejected_by_sglang_parser(fresh, capsys):
    fresh.load_plugins()
    with pytest.raises(SystemExit) as e:
        _parse(ENABLED + ["--draft-graph-capture-backend", "fast"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--draft-graph-capture-backend: invalid choice: 'fast'" in err
    assert "reduce-overhead" in err and "cudagraph" in err


def test_help_lists_the_flags(fresh):
    import argparse

    from sglang.srt.server_args import ServerArgs

    fresh.load_plugins()
    p = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(p)
    plugin.add_arguments(p)  # idempotent per parser
    text = " ".join(p.format_help().split())
    for flag in (config.FLAG, config.BACKEND_FLAG, config.MANIFEST_FLAG):
        assert flag in text
    assert "graphcap draft graph capture (plugin)" in text and "Gemma 4 assistant" in text


def test_without_the_flag_nothing_is_patched(fresh, monkeypatch, glog):
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import ServerArgs

    monkeypatch.setenv(DRAFT_CAPTURE_ENV, "")  # empty: as unset
    modules = ("sglang.srt.speculative.frozen_kv_mtp_worker_v2", "sglang.srt.managers.schedule_batch")
    for mod in modules:  # another test in this process may have imported them: an import now is the plugin's
        monkeypatch.delitem(sys.modules, mod, raising=False)
    fresh.load_plugins()
    sa = _parse(["--model-path", "dummy", "--speculative-algorithm", "NEXTN"])
    assert config.options_of(sa) == DraftCaptureOptions()
    assert set(HookRegistry._hooks) == set(config.ARG_HOOKS)  # only what makes the flags exist
    assert not _wrapped(ServerArgs, "check_server_args")
    assert DRAFT_CAPTURE_ENV not in os.environ or not os.environ[DRAFT_CAPTURE_ENV]
    assert not [r for r in glog.records if r.levelno >= logging.WARNING]
    for mod in modules:
        assert mod not in sys.modules, f"the plugin imported {mod} without the flag"


def test_command_line_wins_over_an_inherited_variable(fresh, monkeypatch):
    monkeypatch.setenv(DRAFT_CAPTURE_ENV, DraftCaptureOptions(enabled=True).to_json())
    fresh.load_plugins()
    sa = _parse(["--model-path", "dummy"])
    assert not config.options_of(sa).enabled
    assert DRAFT_CAPTURE_ENV not in os.environ  # children will not install anything


def test_options_without_the_flag_warn(fresh, glog):
    fresh.load_plugins()
    sa = _parse(["--model-path", "dummy", "--draft-graph-capture-backend", "reduce-overhead"])
    assert not config.options_of(sa).enabled
    assert any("have no effect" in r.getMessage() for r in glog.records)


def test_enabled_installs_the_start_up_check_on_server_args(fresh):
    from sglang.srt.server_args import ServerArgs

    fresh.load_plugins()
    sa = _parse(ENABLED + ["--speculative-eagle-topk", "4"])
    assert _wrapped(ServerArgs, "check_server_args")
    with pytest.raises(compat.DraftCaptureConfigError, match=r"--speculative-eagle-topk must be 1, got 4"):
        sa.check_server_args()  # graphcap's check runs before sglang's (which needs a resolved record)


# -----------------------------------------------------------------------------------------------------------------
# The plugin's environment variables (graphcap.sglang.settings): a bad value of any of them is refused by the
# launcher's start-up check - before sglang starts its scheduler - in one line naming it

UNCREATABLE = "/proc/graphcap-cannot-exist"
# One bad value per variable, and what the line says (every kind of bad value: test_settings.py)
BAD_VARIABLES = [
    (DRAFT_CAPTURE_ENV, '{"enabled": true, "backend": "fast"}', r"backend must be one of .*got 'fast'"),
    (CHECK_ENV, "yes", r"expected 0 or 1, got 'yes'"),
    (TRACE_ENV, UNCREATABLE, rf"={UNCREATABLE}: cannot create it"),
    (TRACE_FLUSH_ENV, "x", r"expected a whole number of draft calls >= 1, got 'x'"),
    (TRACE_PROFILE_ENV, "8,x", r"expected batch sizes >= 1 separated by commas, got '8,x'"),
    (TRACE_HOST_ENV, "0", r"expected a sampling period in milliseconds, 0.1 to 1000, got '0'"),
    (MANIFEST_FLUSH_ENV, "soon", r"expected seconds >= 0, got 'soon'"),
    (MANIFEST_DIR_ENV, UNCREATABLE, rf"={UNCREATABLE}: cannot create it"),
    (ALLOW_UNTESTED_ENV, "2", r"expected 0 or 1, got '2'"),
    (KERNEL_PATHS_ENV, "sm70", r"expected one of native, sm80 \(unset: native\), got 'sm70'"),
    (PDL_ENV, "yes", r"expected 1/on or 0/off \(unset: on\), got 'yes'"),
    (COMPILE_SCOPE_ENV, "graph", r"expected iteration or model, got 'graph'"),
]


def test_every_variable_has_a_start_up_case():
    assert {name for name, _, _ in BAD_VARIABLES} == set(VARIABLES)


@pytest.mark.parametrize("flag", [True, False], ids=["flag", "no-flag"])
@pytest.mark.parametrize("name, raw, match", BAD_VARIABLES, ids=[name for name, _, _ in BAD_VARIABLES])
def test_a_bad_variable_is_refused_by_the_launchers_start_up_check(fresh, monkeypatch, name, raw, match, flag):
    """As the launcher runs: the variable in its environment, sglang's own load_plugins() (graphcap's register()
    raises on the value, which sglang logs, and installs the start-up check), sglang's parser, then the check before
    check_server_args. With or without the flag; the manifest directory is used (and so checked) with it only."""
    from sglang.srt.server_args import ServerArgs

    monkeypatch.setenv(name, raw)
    fresh.load_plugins()
    sa = _parse(ENABLED if flag else ["--model-path", "dummy", "--speculative-algorithm", "NEXTN"])
    if name == DRAFT_CAPTURE_ENV:  # the command line wins over it: an Engine(...)-built record reads it
        setattr(sa, config.ATTR, None)
        monkeypatch.setenv(name, raw)
    if name == MANIFEST_DIR_ENV and not flag:
        assert not config.validate_server_args(sa).enabled
        return
    assert _wrapped(ServerArgs, "check_server_args")
    with pytest.raises(compat.DraftCaptureConfigError) as e:
        sa.check_server_args()
    msg = str(e.value)
    assert "\n" not in msg and f"${name}" in msg and re.search(match, msg), msg


def test_compile_scope_model_needs_the_inductor_backend_at_start_up(fresh, monkeypatch):
    monkeypatch.setenv(COMPILE_SCOPE_ENV, "model")
    fresh.load_plugins()
    with pytest.raises(compat.DraftCaptureConfigError, match=r"^\$GRAPHCAP_SGLANG_COMPILE_SCOPE=model needs "
                                                             r"--draft-graph-capture-backend inductor-cudagraph, "
                                                             r"got cudagraph$"):
        _parse(ENABLED).check_server_args()
    assert config.validate_server_args(_parse(ENABLED + [config.BACKEND_FLAG, "inductor-cudagraph"])).enabled


def test_good_variables_pass_the_start_up_check_and_its_directories_are_made(fresh, monkeypatch, tmp_path):
    good = {CHECK_ENV: "1", TRACE_ENV: str(tmp_path / "trace"), TRACE_FLUSH_ENV: "1", TRACE_PROFILE_ENV: "8,64",
            TRACE_HOST_ENV: "2", MANIFEST_FLUSH_ENV: "0", MANIFEST_DIR_ENV: str(tmp_path / "manifests"),
            ALLOW_UNTESTED_ENV: "0",
            KERNEL_PATHS_ENV: "native", PDL_ENV: "0", COMPILE_SCOPE_ENV: "iteration"}
    for name, value in good.items():
        monkeypatch.setenv(name, value)
    fresh.load_plugins()
    sa = _parse(ENABLED)
    assert config.validate_server_args(sa).enabled
    assert (tmp_path / "trace").is_dir() and (tmp_path / "manifests").is_dir()
    assert plugin_settings().check and plugin_settings().trace_profile == (8, 64)


# -----------------------------------------------------------------------------------------------------------------
# The sglang versions served: the installed one is tested, another is refused at start-up (one error naming them)


def test_the_installed_sglang_is_a_tested_one():
    from graphcap.sglang import compat as sglang_compat

    assert compat.TESTED_SGLANG == ("0.5.18", "0.5.23")
    assert sglang_compat.sglang_version() in compat.TESTED_SGLANG
    assert config.check_sglang_version() == sglang_compat.sglang_version()


UNTESTED = r"sglang 0\.5\.99 is installed; graphcap's plugin is tested with sglang 0\.5\.18, 0\.5\.23 only"


@pytest.mark.parametrize("version", ["0.5.99", "0.5.17", "0.6.0", None])
def test_an_untested_sglang_is_refused_naming_the_versions_tested(monkeypatch, glog, version):
    from graphcap.sglang import compat as sglang_compat

    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    monkeypatch.setattr(sglang_compat, "sglang_version", lambda: version)
    what = f"sglang {version}" if version else "an sglang without package metadata"
    with pytest.raises(compat.DraftCaptureConfigError, match=rf"{re.escape(what)} is installed; .*tested with sglang "
                                                             r"0\.5\.18, 0\.5\.23 only"):
        config.check_sglang_version()
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")  # the developers' escape hatch: a warning instead
    assert config.check_sglang_version() == version
    assert any("tested with sglang 0.5.18, 0.5.23 only" in r.getMessage() for r in glog.records)
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "yes")
    with pytest.raises(compat.DraftCaptureConfigError, match=r"\$GRAPHCAP_SGLANG_ALLOW_UNTESTED: expected 0 or 1, "
                                                             r"got 'yes'"):
        config.check_sglang_version()


def test_the_start_up_check_refuses_an_untested_sglang_first(fresh, monkeypatch):
    """The launcher's check (BEFORE check_server_args) refuses with the flag, before reading any argument; without
    the flag an untested sglang starts as it would without graphcap."""
    from graphcap.sglang import compat as sglang_compat

    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    fresh.load_plugins()
    sa = _parse(ENABLED + ["--speculative-eagle-topk", "4"])  # refused for its version before its top-k
    monkeypatch.setattr(sglang_compat, "sglang_version", lambda: "0.5.99")
    with pytest.raises(compat.DraftCaptureConfigError, match=UNTESTED):
        sa.check_server_args()
    assert not config.validate_server_args(_parse(["--model-path", "dummy"])).enabled


def test_register_on_an_untested_sglang_with_the_flag_installs_only_the_check(fresh, monkeypatch, glog):
    """A child process (or an Engine user) with the flag in the environment on an untested sglang: register() raises
    the version error (sglang's load_plugins logs it and carries on), and leaves only the flags and the start-up
    check installed - no worker hook, so nothing of graphcap serves; the check then refuses where the arguments are
    checked. Without the flag: the flags, and a warning."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from graphcap.sglang import compat as sglang_compat

    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    monkeypatch.setattr(sglang_compat, "sglang_version", lambda: "0.5.99")
    monkeypatch.setitem(sys.modules, config.SCHEDULER_MODULE, sys.modules.get(config.SCHEDULER_MODULE) or object())
    monkeypatch.setenv(DRAFT_CAPTURE_ENV, DraftCaptureOptions(enabled=True).to_json())
    with pytest.raises(compat.DraftCaptureConfigError, match=UNTESTED):
        plugin.register()
    assert set(HookRegistry._hooks) == {*config.ARG_HOOKS, config.CHECK_SERVER_ARGS}
    fresh.load_plugins()  # as sglang runs it: the error logged, the process goes on
    assert set(HookRegistry._hooks) == {*config.ARG_HOOKS, config.CHECK_SERVER_ARGS}
    sa = _parse(["--model-path", "dummy", "--speculative-algorithm", "NEXTN"])
    setattr(sa, config.ATTR, None)  # an Engine(...)-built record: the options come from the environment
    monkeypatch.setenv(DRAFT_CAPTURE_ENV, DraftCaptureOptions(enabled=True).to_json())
    with pytest.raises(compat.DraftCaptureConfigError, match=UNTESTED):
        sa.check_server_args()
    HookRegistry.reset()
    plugin.STATE.runtime_hooks.clear()
    monkeypatch.setenv(DRAFT_CAPTURE_ENV, "")
    plugin.register()
    assert set(HookRegistry._hooks) == set(config.ARG_HOOKS)
    assert any("sglang 0.5.99 is installed" in r.getMessage() and "refuses to start" in r.getMessage()
               for r in glog.records)


# -----------------------------------------------------------------------------------------------------------------
# Start-up validation on sglang's own parsed (and, where resolution needs a model, declared-resolved) records


def _resolved(sa, **fields):
    """What sglang's resolution pipeline would have declared (it needs the model's config to run for real), by the
    installed sglang's own functions: 0.5.23 stashes declarations and marks the record resolved; 0.5.18 stashes them
    and materializes them onto the fields at the end of resolution."""
    from sglang.srt.arg_groups import overrides

    if hasattr(overrides, "declare_resolution"):  # 0.5.23
        if fields:
            overrides.declare_resolution(sa, "test", **fields)
        sa._resolution_finished = True
    else:  # 0.5.18
        sa._resolved_overrides.append(("test", dict(fields)))
        overrides.materialize_declarations(sa)
    return sa


def _parse_cuda_graph_config(sa) -> None:
    """sglang's own resolution of the CUDA-graph flags into cuda_graph_config (a hook of its own in 0.5.23, a
    ServerArgs handler in 0.5.18)."""
    try:
        from sglang.srt.arg_groups.cuda_graph_hook import parse_cuda_graph_config
    except ModuleNotFoundError:  # 0.5.18
        sa._parse_cuda_graph_config()
    else:
        parse_cuda_graph_config(sa)


def needs_field(name: str):
    """A case about a ServerArgs field one of the tested sglang versions lacks (0.5.18 has no `attn_dp_size`: its
    attention DP is `--enable-dp-attention` with `--dp-size` alone)."""
    from sglang.srt.server_args import ServerArgs

    from graphcap.sglang.compat import sglang_version

    return pytest.mark.skipif(not hasattr(ServerArgs, name),  # a field (msgspec 0.5.23, dataclass 0.5.18) or not
                              reason=f"sglang {sglang_version()} has no ServerArgs.{name}")


@pytest.mark.parametrize("argv, resolved, match", [
    (["--speculative-algorithm", "EAGLE3"], dict(speculative_algorithm="EAGLE3"), r"resolved to EAGLE3"),
    (["--speculative-algorithm", "NGRAM"], None, r"supports only FROZEN_KV_MTP .* resolved to NGRAM"),
    (["--speculative-algorithm", "NEXTN"], dict(speculative_algorithm="EAGLE"), r"resolved to EAGLE\b"),
    (["--speculative-eagle-topk", "4"], None, r"--speculative-eagle-topk must be 1, got 4"),
    (["--attention-backend", "flashinfer"], None, r"--attention-backend flashinfer is not supported"),
    (["--decode-attention-backend", "fa3"], None, r"--decode-attention-backend fa3 is not supported"),
    (["--attention-backend", "triton", "--speculative-draft-attention-backend", "trtllm_mha"], None,
     r"--speculative-draft-attention-backend trtllm_mha is not supported"),
    (["--enable-unified-memory"], None, r"--enable-unified-memory"),
    (["--pp-size", "2"], None, r"--pp-size 2 is not supported"),
    (["--draft-graph-capture-backend", "reduce-overhead"], None,
     r"--draft-graph-capture-backend reduce-overhead is not supported in sglang's engine: .*crashed"),
    (["--enable-torch-compile", "--draft-graph-capture-backend", "inductor-cudagraph"], None,
     r"--draft-graph-capture-backend inductor-cudagraph with --enable-torch-compile"),
    pytest.param(["--attn-dp-size", "2"], None, r"attention data parallelism \(--attn-dp-size 2\) is not supported",
                 marks=needs_field("attn_dp_size")),
    (["--dp-size", "2", "--enable-dp-attention"], None, r"\(--enable-dp-attention with --dp-size 2\)"),
    # what sglang 0.5.23's handle_deprecated_dp_attention declares for the same flags (it needs the stubbed
    # torchvision); 0.5.18 keeps them as given (the case above)
    pytest.param(["--dp-size", "2", "--enable-dp-attention"],
                 dict(speculative_algorithm="FROZEN_KV_MTP", attn_dp_size=2, dp_size=1, enable_dp_attention=False),
                 r"attention data parallelism \(--attn-dp-size 2\)", marks=needs_field("attn_dp_size")),
    (["--draft-graph-manifest-dir", "/proc/graphcap-cannot-exist"], None, r"--draft-graph-manifest-dir .*cannot create"),
])
def test_unsupported_settings_are_named(fresh, argv, resolved, match):
    """Each refused setting is named in the error (reduce-overhead: sglang's engine crashed with it; the
    `--enable-torch-compile` case: graphcap's compiling backends patch sglang's layer boundaries, which sglang's own
    fullgraph compile of the target cannot take)."""
    fresh.load_plugins()
    argv = [a for a in ENABLED if a not in ("--speculative-algorithm", "NEXTN")] + (
        argv if "--speculative-algorithm" in argv else ["--speculative-algorithm", "NEXTN"] + argv)
    sa = _parse(argv)
    if resolved is not None:
        _resolved(sa, **resolved)
    with pytest.raises(compat.DraftCaptureConfigError, match=match):
        config.validate_server_args(sa)


NO_PREFILL = ["--cuda-graph-backend-prefill", "disabled"]


@pytest.mark.parametrize("on_cuda", [False, True], ids=["cpu-host", "cuda-host"])
@pytest.mark.parametrize("argv, named", [
    (["--disable-cuda-graph"], "--disable-cuda-graph"),
    (["--cuda-graph-backend-decode", "disabled", *NO_PREFILL], "--cuda-graph-backend-decode disabled"),
    (["--disable-decode-cuda-graph", *NO_PREFILL], "--disable-decode-cuda-graph"),
    (["--cuda-graph-backend-decode", "disabled"], "prefill default"),  # prefill graphs: sglang's default per host
    (["--disable-cuda-graph", "--cuda-graph-backend-decode", "full"], None),  # sglang's precedence: decode keeps graphs
    ([], None),
])
def test_disabled_cuda_graphs_are_refused_at_start_up(fresh, monkeypatch, argv, named, on_cuda):
    """Refused by the launcher's check (not after the model has loaded), on the cuda_graph_config that sglang's own
    resolution hook makes of the flags; refused exactly when sglang would capture no draft graph either
    (`cuda_graph_fully_disabled`: decode and prefill both off). sglang's prefill default depends on the host
    (breakable graphs on CUDA; elsewhere none in 0.5.23, tc_piecewise in 0.5.18: sglang's own
    `default_prefill_backend` says), so both hosts are resolved."""
    import sglang.srt.utils as sgl_utils
    from sglang.srt.model_executor.cuda_graph_config import Backend, default_prefill_backend

    monkeypatch.setattr(sgl_utils, "is_cuda", lambda: on_cuda)
    if named == "prefill default":  # decode off alone: refused where prefill has no graphs by default
        named = None if default_prefill_backend() != Backend.DISABLED else "--cuda-graph-backend-decode disabled"
    fresh.load_plugins()
    sa = _parse(ENABLED + argv)
    _parse_cuda_graph_config(sa)
    _resolved(sa, speculative_algorithm="FROZEN_KV_MTP", device="cuda")
    if named is None:
        assert config.validate_server_args(sa).enabled
    else:
        with pytest.raises(compat.DraftCaptureConfigError, match=rf"CUDA graphs are disabled \({re.escape(named)}\)"):
            config.validate_server_args(sa)


def test_start_up_check_on_a_cpu_device_stays_off_before_refusing_graphs(fresh):
    """Off a GPU sglang's resolution disables CUDA graphs itself: that is the safe 'stays off', not an error."""
    fresh.load_plugins()
    sa = _parse(ENABLED + ["--disable-cuda-graph"])
    _parse_cuda_graph_config(sa)
    _resolved(sa, speculative_algorithm="FROZEN_KV_MTP", device="cpu")
    assert not config.validate_server_args(sa).enabled


@pytest.mark.parametrize("argv, resolved, why", [
    (["--model-path", "dummy", "--enable-draft-graph-capture"], {}, "no --speculative-algorithm"),
    (ENABLED, dict(speculative_algorithm="FROZEN_KV_MTP", device="cpu"), "--device cpu"),
])
def test_safe_cases_warn_and_stay_off(fresh, glog, argv, resolved, why):
    fresh.load_plugins()
    sa = _resolved(_parse(argv), **resolved)
    assert os.environ.get(DRAFT_CAPTURE_ENV)
    opts = config.validate_server_args(sa)
    assert not opts.enabled and not config.options_of(sa).enabled  # stored back on the (sealed) record
    assert DRAFT_CAPTURE_ENV not in os.environ  # the scheduler subprocesses will install nothing
    assert any(why in r.getMessage() and "stays off" in r.getMessage() for r in glog.records)


@pytest.mark.parametrize("argv, resolved", [
    (ENABLED, None),  # before resolution NEXTN may still become FROZEN_KV_MTP
    (ENABLED + ["--attention-backend", "triton", "--speculative-eagle-topk", "1"],
     dict(speculative_algorithm="FROZEN_KV_MTP", device="cuda")),
])
def test_supported_configuration_passes(fresh, argv, resolved, tmp_path):
    fresh.load_plugins()
    sa = _parse(argv + ["--draft-graph-manifest-dir", str(tmp_path / "m")])
    if resolved is not None:
        _resolved(sa, **resolved)
    opts = config.validate_server_args(sa)
    assert opts.enabled and (tmp_path / "m").is_dir()


def test_environment_path_for_engine_users(fresh, monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setenv(DRAFT_CAPTURE_ENV, json.dumps({"enabled": True, "backend": "cudagraph", "manifest_dir": None}))
    fresh.load_plugins()
    assert config.options_of(None) == DraftCaptureOptions(enabled=True, backend="cudagraph")
    assert config.CHECK_SERVER_ARGS in HookRegistry._patched
    monkeypatch.setenv(DRAFT_CAPTURE_ENV, '{"enabled": true, "backend": "fast"}')
    with pytest.raises(compat.DraftCaptureConfigError,
                       match=r"backend must be one of reduce-overhead, inductor-cudagraph, cudagraph"):
        plugin_settings()


def test_engine_users_asking_for_reduce_overhead_are_refused_too(fresh, monkeypatch):
    """The Engine path (options from the environment, no command line) meets the same start-up refusal."""
    fresh.load_plugins()
    sa = _parse(["--model-path", "dummy", "--speculative-algorithm", "NEXTN"])
    setattr(sa, config.ATTR, None)  # what an Engine(...)-built record carries: nothing of graphcap's
    monkeypatch.setenv(DRAFT_CAPTURE_ENV, json.dumps({"enabled": True, "backend": "reduce-overhead",
                                                     "manifest_dir": None}))
    assert config.options_of(sa).backend == "reduce-overhead"
    with pytest.raises(compat.DraftCaptureConfigError, match=r"reduce-overhead is not supported in sglang's engine"):
        config.validate_server_args(sa)
    monkeypatch.setenv(DRAFT_CAPTURE_ENV, json.dumps({"enabled": True, "backend": "inductor-cudagraph",
                                                   "manifest_dir": None}))
    assert config.validate_server_args(sa).backend == "inductor-cudagraph"


def test_half_installed_hooks_refuse_to_serve(fresh, monkeypatch):
    """sglang logs a hook it could not install and carries on: graphcap must then refuse (naming the hooks) rather
    than serve with windows that never advance. Checked before anything else of the worker is touched."""
    from types import SimpleNamespace

    from sglang.srt.plugins.hook_registry import HookRegistry

    from graphcap.sglang import hooks as hooks

    monkeypatch.setattr(HookRegistry, "_patched", set(config.WORKER_HOOKS) - {config.WORKER_EXTEND_DECODE})
    monkeypatch.setenv(DRAFT_CAPTURE_ENV, "")  # attach_options exports it: removed again after the test
    server_args = SimpleNamespace()
    config.attach_options(server_args, DraftCaptureOptions(enabled=True))
    worker = SimpleNamespace(server_args=server_args)
    called = []
    with pytest.raises(compat.DraftCaptureConfigError, match=config.WORKER_EXTEND_DECODE.replace(".", r"\.")):
        hooks.around_init_cuda_graphs(lambda *a, **k: called.append(1), worker)
    assert not called and not hasattr(worker, hooks.RUNTIME_ATTR)
    monkeypatch.setattr(HookRegistry, "_patched", set(config.WORKER_HOOKS))
    assert config.unpatched_worker_hooks() == []


@settings(max_examples=examples(40), deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 6), ties=st.integers(0, 3))
def test_greedy_token_is_sglangs_softmax_then_fast_topk(seed, rows, ties):
    """The plugin's greedy pick (max over the logits) against sglang's own (`fast_topk(softmax(logits), 1)`) on bf16
    logits of a trained head's scale, with exact ties planted at the top (both take the first index)."""
    import torch
    from sglang.srt.utils.common import fast_topk

    from graphcap.sglang.loop import greedy_token

    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, 4096, generator=g) * 4).to(torch.bfloat16)
    for r in range(min(ties, rows)):  # a second copy of the row's top logit at a random earlier or later index
        top = int(logits[r].float().argmax())
        logits[r, int(torch.randint(0, 4096, (1,), generator=g))] = logits[r, top]
    probs, want = fast_topk(torch.softmax(logits, dim=-1), 1, dim=-1)
    tokens, score = greedy_token(logits)
    assert torch.equal(tokens, want[:, 0])
    assert score.dtype == torch.float32 and torch.equal(score, logits.float().gather(1, want)[:, 0])


@settings(max_examples=examples(40), deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 6), k=st.integers(1, 6), ties=st.integers(0, 3))
def test_greedy_pick_from_candidates_is_the_pick_from_the_full_row(seed, rows, k, ties):
    """The loop's greedy pick of a marked batch's output (the head's candidates) against its pick of the
    full-vocabulary row sglang's head builds from the same candidates (mask value elsewhere, `centroid_masking`'s
    fill + scatter): the same token and logit, exact ties planted at the top of a row (the smallest token id wins
    either way). The kernel's own cases (NaN, bad clusters) are in test_candidate_pick.py."""
    import types

    import torch

    from graphcap.sglang.head import HeadCandidates
    from graphcap.sglang.loop import greedy_pick

    g = torch.Generator().manual_seed(seed)
    clusters, per = 128, 16
    ordering = torch.randperm(clusters * per, generator=g)
    top = torch.stack([torch.randperm(clusters, generator=g)[:k] for _ in range(rows)])
    values = (torch.randn(rows, k * per, generator=g) * 4).to(torch.bfloat16)
    for r in range(min(ties, rows)):  # a second copy of the row's top logit elsewhere among its candidates
        values[r, int(torch.randint(0, k * per, (1,), generator=g))] = values[r].max()
    full = torch.full((rows, clusters * per), torch.finfo(torch.bfloat16).min / 2, dtype=torch.bfloat16)
    full.scatter_(1, ordering.view(clusters, per)[top].view(rows, -1), values)
    want_tok, want_score = greedy_pick(types.SimpleNamespace(next_token_logits=full))
    tok, score = greedy_pick(HeadCandidates(values, top, ordering, per, None))
    assert torch.equal(tok, want_tok) and torch.equal(score, want_score) and score.dtype == torch.float32