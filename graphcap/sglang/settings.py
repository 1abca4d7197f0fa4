"""The sglang plugin's settings: the options its flags set (`DraftCaptureOptions`) and every environment variable it
reads (`PluginSettings`), each parsed here and nowhere else.

A bad value is a `DraftCaptureConfigError` naming the variable, the value and what it takes. The plugin's start-up
check (`graphcap.sglang.config.validate_server_args`, in the launcher before sglang starts its scheduler) parses them
all, so a typo is refused at launch rather than where the scheduler first reads it; the runtime and the trace take
their values from the parsed object. Three variables are the library's own (`GRAPHCAP_MANIFEST_DIR`,
`GRAPHCAP_KERNEL_PATHS`, `GRAPHCAP_PDL`): `graphcap.envvars` parses them, here as where the library reads them.

Light (no torch): the launcher's check imports this. Imports only `compat` of the plugin (its error class);
`config` and everything above it import this.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from graphcap import envvars
from graphcap.backends import GRAPH_BACKENDS  # light: no torch
from graphcap.sglang.compat import DraftCaptureConfigError

# The plugin's default backend. sglang's Gemma 4 layers already run one fused kernel per norm, activation and rotary,
# so recording them as they are leaves Inductor little to fuse, and Dynamo breaks the graph at every layer boundary
# (sglang 0.5.23 builds msgspec records there). Both backends it serves give sglang's tokens in its own engine;
# `cudagraph` starts about 40 s sooner (no compile) and was as fast or faster at 3 of 4 batches (docs/results.md,
# "How much faster is the draft phase?").
PLUGIN_DEFAULT_BACKEND = "cudagraph"
# Whose kernels run the draft model's projections inside graphcap's captured iteration: graphcap's skinny GEMM up
# to 8 rows, sglang's above (graphcap.sglang.linear), or sglang's own at every batch.
PROJECTIONS = ("graphcap", "sglang")
# Whose kernel runs the target verify's attention: graphcap's split-KV verify kernel in sglang's Triton backend
# (graphcap.sglang.verify), or sglang's extend kernel.
VERIFY_ATTENTION = ("graphcap", "sglang")
# What torch.compile traces under inductor-cudagraph: the whole draft iteration, or only sglang's model forward
# (as sglang's own --enable-torch-compile does), the rest eager, all recorded in one graph.
COMPILE_SCOPES = ("iteration", "model")

# The variables (docs/sglang.md, "Environment variables").
DRAFT_CAPTURE_ENV = "GRAPHCAP_SGLANG_DRAFT_CAPTURE"  # the flags' options as JSON: Engine users, the launcher's children
CHECK_ENV = "GRAPHCAP_SGLANG_CHECK"
TRACE_ENV = "GRAPHCAP_SGLANG_TRACE"
TRACE_FLUSH_ENV = "GRAPHCAP_SGLANG_TRACE_FLUSH"
TRACE_PROFILE_ENV = "GRAPHCAP_SGLANG_TRACE_PROFILE"
TRACE_HOST_ENV = "GRAPHCAP_SGLANG_TRACE_HOST"
MANIFEST_FLUSH_ENV = "GRAPHCAP_MANIFEST_FLUSH_S"
ALLOW_UNTESTED_ENV = "GRAPHCAP_SGLANG_ALLOW_UNTESTED"
COMPILE_SCOPE_ENV = "GRAPHCAP_SGLANG_COMPILE_SCOPE"


@dataclass(frozen=True)
class DraftCaptureOptions:
    """What the plugin's flags say (graphcap.sglang.config wires them into sglang's parser)."""

    enabled: bool = False
    backend: str = PLUGIN_DEFAULT_BACKEND
    manifest_dir: str | None = None  # None: graphcap's default ($GRAPHCAP_MANIFEST_DIR or ~/.cache/graphcap/...)
    projections: str = PROJECTIONS[0]
    verify_attention: str = VERIFY_ATTENTION[0]

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_mapping(cls, data: Any, source: str) -> DraftCaptureOptions:
        keys = [f.name for f in fields(cls)]
        if not isinstance(data, dict) or set(data) - set(keys):
            raise DraftCaptureConfigError(f"{source}: expected a JSON object with keys {', '.join(keys)}; "
                                          f"got {data!r}")
        opts = cls(**data)
        if not isinstance(opts.enabled, bool):
            raise DraftCaptureConfigError(f"{source}: enabled must be true or false, got {opts.enabled!r}")
        if opts.backend not in GRAPH_BACKENDS:
            raise DraftCaptureConfigError(f"{source}: backend must be one of {', '.join(GRAPH_BACKENDS)}, "
                                          f"got {opts.backend!r}")
        if opts.manifest_dir is not None and not isinstance(opts.manifest_dir, str):
            raise DraftCaptureConfigError(f"{source}: manifest_dir must be a string, got {opts.manifest_dir!r}")
        if opts.projections not in PROJECTIONS:
            raise DraftCaptureConfigError(f"{source}: projections must be one of {', '.join(PROJECTIONS)}, "
                                          f"got {opts.projections!r}")
        if opts.verify_attention not in VERIFY_ATTENTION:
            raise DraftCaptureConfigError(f"{source}: verify_attention must be one of {', '.join(VERIFY_ATTENTION)}, "
                                          f"got {opts.verify_attention!r}")
        return opts


# -----------------------------------------------------------------------------------------------------------------
# One parser per kind of value: (variable, its value, never empty) -> the field's value, or an error naming all three


def _bad(name: str, raw: str, expected: str) -> DraftCaptureConfigError:
    return DraftCaptureConfigError(f"${name}: expected {expected}, got {raw!r}")


def _switch(name: str, raw: str) -> bool:
    if raw not in ("0", "1"):
        raise _bad(name, raw, "0 or 1")
    return raw == "1"


def _draft_capture(name: str, raw: str) -> DraftCaptureOptions:
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise DraftCaptureConfigError(f"${name}: not valid JSON ({e})") from None
    return DraftCaptureOptions.from_mapping(data, f"${name}")


def _directory(name: str, raw: str) -> str:
    return raw  # whether it can be created and written: the start-up check's (it touches the file system)


def _draft_calls(name: str, raw: str) -> int:
    if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:
        raise _bad(name, raw, "a whole number of draft calls >= 1")
    return int(raw)


def _batch_sizes(name: str, raw: str) -> tuple[int, ...]:
    items = [x.strip() for x in raw.split(",") if x.strip()]
    if not all(x.isascii() and x.isdigit() and int(x) >= 1 for x in items):
        raise _bad(name, raw, "batch sizes >= 1 separated by commas")
    return tuple(int(x) for x in items)


def _seconds(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # NaN too
        raise _bad(name, raw, "seconds >= 0")
    return value


def _interval_ms(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not 0.1 <= value <= 1000:  # NaN too; finer than 0.1 ms would be the sampler's own cost
        raise _bad(name, raw, "a sampling period in milliseconds, 0.1 to 1000")
    return value


def _compile_scope(name: str, raw: str) -> str:
    if raw not in COMPILE_SCOPES:
        raise _bad(name, raw, " or ".join(COMPILE_SCOPES))
    return raw


def _library(parse: Callable[[str], Any]) -> Callable[[str, str], Any]:
    """A library variable's parser (graphcap.envvars: ValueError naming the variable) as the plugin's error."""
    def parse_plugin(name: str, raw: str) -> Any:
        try:
            return parse(raw)
        except ValueError as e:
            raise DraftCaptureConfigError(str(e)) from None
    return parse_plugin


def _var(name: str, parse: Callable[[str, str], Any], default: Any) -> Any:
    return field(default=default, metadata={"env": name, "parse": parse})


@dataclass(frozen=True)
class PluginSettings:
    """Every environment variable the plugin reads, parsed (`from_env`). An unset or empty variable takes the
    field's default; the meanings are docs/sglang.md's ("Environment variables")."""

    draft_capture: DraftCaptureOptions = _var(DRAFT_CAPTURE_ENV, _draft_capture, DraftCaptureOptions())
    check: bool = _var(CHECK_ENV, _switch, False)  # every draft checked against sglang's state (syncs)
    trace_dir: str | None = _var(TRACE_ENV, _directory, None)  # the draft trace's directory (graphcap.sglang.trace)
    trace_flush: int = _var(TRACE_FLUSH_ENV, _draft_calls, 16)  # draft calls per read-back of the trace
    trace_profile: tuple[int, ...] = _var(TRACE_PROFILE_ENV, _batch_sizes, ())  # batch sizes whose kernels are profiled
    trace_host_ms: float | None = _var(TRACE_HOST_ENV, _interval_ms, None)  # the host sampler's period (host_samples)
    manifest_flush_s: float = _var(MANIFEST_FLUSH_ENV, _seconds, 10.0)  # seconds between manifest writes
    manifest_dir: Path | None = _var(envvars.MANIFEST_DIR_ENV, _library(envvars.parse_manifest_dir), None)
    allow_untested: bool = _var(ALLOW_UNTESTED_ENV, _switch, False)  # another sglang: a warning, not an error
    kernel_paths: str = _var(envvars.KERNEL_PATHS_ENV, _library(envvars.parse_kernel_paths), envvars.NATIVE)
    pdl: bool = _var(envvars.PDL_ENV, _library(envvars.parse_pdl), True)
    compile_scope: str = _var(COMPILE_SCOPE_ENV, _compile_scope, COMPILE_SCOPES[0])

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> PluginSettings:
        """The settings `environ` holds; the first bad value is a DraftCaptureConfigError naming the variable, the
        value and what it takes."""
        values = {}
        for f in fields(cls):
            raw = environ.get(f.metadata["env"])
            if raw:  # an empty variable counts as unset
                values[f.name] = f.metadata["parse"](f.metadata["env"], raw)
        return cls(**values)


VARIABLES: dict[str, str] = {f.metadata["env"]: f.name for f in fields(PluginSettings)}  # variable -> field
_PARSED: tuple[tuple[str | None, ...], PluginSettings] | None = None  # the raw values and what they parsed to


def plugin_settings() -> PluginSettings:
    """This process's settings: parsed from `os.environ` at the first call and kept. Parsed again only where one of
    the variables changed since - the launcher exports the flag's options for its children (`config.attach_options`),
    a test or a bench sets one between runtimes - so a value in force is always the environment's. A bad value
    raises at every call (DraftCaptureConfigError), so whichever reads the settings first names it."""
    global _PARSED
    raw = tuple(os.environ.get(name) for name in VARIABLES)
    if _PARSED is None or _PARSED[0] != raw:
        _PARSED = (raw, PluginSettings.from_env(os.environ))
    return _PARSED[1]
