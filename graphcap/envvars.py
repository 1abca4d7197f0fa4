"""The library's own environment variables, each parsed here and nowhere else.

- `GRAPHCAP_MANIFEST_DIR`: where manifests go by default (`graphcap.manifest.default_manifest_dir`);
- `GRAPHCAP_KERNEL_PATHS`: `sm80` forces the paths an A100 takes (`graphcap.kernels.arch`); unset or `native`: the
  device's own.
- `GRAPHCAP_PDL`: `0`/`off` launches graphcap's kernels without programmatic dependent launch (graphcap.kernels.pdl);
  unset, `1` or `on`: with it, where the GPU has it.

The library reads them where it uses them; the sglang plugin's start-up check parses them with its own variables
(`graphcap.sglang.settings`), so a bad value is refused at launch. No torch: that check and `graphcap inspect` import
this.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

MANIFEST_DIR_ENV = "GRAPHCAP_MANIFEST_DIR"
KERNEL_PATHS_ENV = "GRAPHCAP_KERNEL_PATHS"
PDL_ENV = "GRAPHCAP_PDL"
NATIVE = "native"
# The forced descriptions' names, beside "native"; graphcap.kernels.arch.PATHS maps each to its GpuArch
FORCED_KERNEL_PATHS = ("sm80",)


def parse_manifest_dir(value: str) -> Path:
    """A value of `$GRAPHCAP_MANIFEST_DIR` (not empty): the directory, `~` expanded."""
    return Path(value).expanduser()


def manifest_dir(environ: Mapping[str, str]) -> Path | None:
    """`$GRAPHCAP_MANIFEST_DIR`'s directory; None where it is unset or empty."""
    raw = environ.get(MANIFEST_DIR_ENV)
    return parse_manifest_dir(raw) if raw else None


def parse_kernel_paths(value: str) -> str:
    """A value of `$GRAPHCAP_KERNEL_PATHS` as `native` or one of FORCED_KERNEL_PATHS (case and spaces ignored, empty:
    native); a bad value is a ValueError naming the variable, the value and the values it takes."""
    key = value.strip().lower()
    if key in ("", NATIVE):
        return NATIVE
    if key not in FORCED_KERNEL_PATHS:
        raise ValueError(f"${KERNEL_PATHS_ENV}: expected one of {', '.join((NATIVE, *FORCED_KERNEL_PATHS))} "
                         f"(unset: {NATIVE}), got {value!r}")
    return key


def kernel_paths(environ: Mapping[str, str]) -> str:
    """`$GRAPHCAP_KERNEL_PATHS` (`parse_kernel_paths`); unset: native."""
    return parse_kernel_paths(environ.get(KERNEL_PATHS_ENV, ""))


def parse_pdl(value: str) -> bool:
    """A value of `$GRAPHCAP_PDL`: False for `0`/`off`, True for `1`/`on` (case and spaces ignored, empty: on); a
    bad value is a ValueError naming the variable, the value and the values it takes."""
    key = value.strip().lower()
    if key in ("", "1", "on"):
        return True
    if key in ("0", "off"):
        return False
    raise ValueError(f"${PDL_ENV}: expected 1/on or 0/off (unset: on), got {value!r}")


def pdl(environ: Mapping[str, str]) -> bool:
    """`$GRAPHCAP_PDL` (`parse_pdl`); unset: on."""
    return parse_pdl(environ.get(PDL_ENV, ""))
