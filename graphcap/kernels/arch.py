"""The GPU graphcap's kernels plan for, as one description (`GpuArch`), and the switch that forces the paths an
A100 takes (`GRAPHCAP_KERNEL_PATHS=sm80`, parsed by graphcap.envvars), read here and nowhere else.

graphcap's own code uses one Hopper-only feature, programmatic dependent launch (graphcap.kernels.pdl, taken where
the description is `hopper`), and no TMA, tensor descriptors or bulk copies; what differs by GPU is what the
planners derive from the device's limits (shared memory per block and per SM, SM count) and what Triton's compiler
picks for the capability it compiles for (on sm_90 wgmma for tl.dot, on sm_80 mma.sync with cp.async pipelining). Planners take a `GpuArch` (tests pass `SM80` / `SM90` on a CPU), or
ask `device_arch(device)`.

The switch: `GRAPHCAP_KERNEL_PATHS=sm80` (unset or `native`: the device's own). Under it every description is
`SM80` capped by the device's own limits (on an H200: exactly `SM80`), and `apply_triton_arch` - run when
graphcap.kernels is imported - sets Triton's `TRITON_OVERRIDE_ARCH=sm80`, so Triton lowers every kernel it
compiles in this process from then on for capability 80 (its knob is process-wide: sglang's Triton kernels
compiled after the import too, as on an A100) while ptxas still emits the device's own SASS (Triton 3.9: PTX
`.target` and ptxas `--gpu-name` come from the device, only the lowering from the override).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from graphcap import envvars

TRITON_ENV = "TRITON_OVERRIDE_ARCH"  # Triton's knob (knobs.runtime.override_arch): the capability it lowers for


@dataclass(frozen=True)
class GpuArch:
    """What the planners need of a GPU. Byte counts as CUDA reports them (`shared_memory_per_block_optin`,
    `shared_memory_per_multiprocessor`)."""

    name: str
    major: int
    minor: int
    smem_per_block: int  # shared memory one block may opt into
    smem_per_sm: int  # and one multiprocessor holds
    sm_count: int

    def __post_init__(self) -> None:
        for field in ("major", "minor", "smem_per_block", "smem_per_sm", "sm_count"):
            v, least = getattr(self, field), 0 if field == "minor" else 1
            if not isinstance(v, int) or isinstance(v, bool) or v < least:
                raise ValueError(f"GpuArch {self.name}: {field} must be an int >= {least}, got {v!r}")

    @property
    def capability(self) -> tuple[int, int]:
        return self.major, self.minor

    @property
    def hopper(self) -> bool:
        """sm_90's features (TMA, wgmma, programmatic dependent launch, bulk copies) exist: major >= 9."""
        return self.major >= 9

    def within(self, device: GpuArch) -> GpuArch:
        """This description capped by `device`'s: never a limit the device does not have."""
        return GpuArch(self.name, *min(self.capability, device.capability),
                       min(self.smem_per_block, device.smem_per_block), min(self.smem_per_sm, device.smem_per_sm),
                       min(self.sm_count, device.sm_count))


SM90 = GpuArch("sm90", 9, 0, smem_per_block=232448, smem_per_sm=233472, sm_count=132)  # H200 (227 / 228 KiB)
# A100 (GA100 at 108 SMs; other GA100 boards have fewer SMs, which a real device reports)
SM80 = GpuArch("sm80", 8, 0, smem_per_block=166912, smem_per_sm=167936, sm_count=108)  # 163 / 164 KiB
PATHS = {"sm80": SM80}  # the switch's values, beside "native" (envvars.FORCED_KERNEL_PATHS names the same)


@functools.lru_cache(maxsize=None)
def kernel_paths() -> GpuArch | None:
    """The forced description (`GRAPHCAP_KERNEL_PATHS`), None for the device's own; a bad value is a ValueError
    naming the variable and the values it takes (`envvars.kernel_paths`). Read once per process, as Triton's override
    is set once (`apply_triton_arch`); a test that changes the variable calls `kernel_paths.cache_clear()`."""
    key = envvars.kernel_paths(os.environ)
    return None if key == envvars.NATIVE else PATHS[key]


def device_arch(device: torch.device | str | None = None) -> GpuArch:
    """The description planners use for `device` (None: the current CUDA device where there is one): the device's
    own, or under the switch the forced one capped by it. A CPU (Triton's interpreter) plans what an H200 would
    (`SM90`; under the switch `SM80`). Cheap (cached): the ops call it per launch."""
    if device is not None and not isinstance(device, torch.device):
        device = torch.device(device)
    if device is not None and device.type != "cuda":
        index = -1
    elif device is not None and device.index is not None:
        index = device.index
    else:
        index = torch.cuda.current_device() if _cuda() else -1
    forced = kernel_paths()
    return _arch_of(index, forced.name if forced is not None else "")


@functools.lru_cache(maxsize=None)
def _cuda() -> bool:
    return torch.cuda.is_available()


@functools.lru_cache(maxsize=None)
def _arch_of(index: int, forced: str) -> GpuArch:
    native = _native(index) if index >= 0 and _cuda() else SM90
    return PATHS[forced].within(native) if forced else native


@functools.lru_cache(maxsize=None)
def _native(index: int) -> GpuArch:
    p = torch.cuda.get_device_properties(index)
    return GpuArch(f"sm{p.major}{p.minor}", p.major, p.minor,
                   int(getattr(p, "shared_memory_per_block_optin", 0) or SM90.smem_per_block),
                   int(getattr(p, "shared_memory_per_multiprocessor", 0) or SM90.smem_per_sm),
                   p.multi_processor_count)


def triton_arch() -> str | None:
    """The capability Triton must lower for under the switch (`TRITON_OVERRIDE_ARCH`'s form), None without it."""
    forced = kernel_paths()
    return f"sm{forced.major}{forced.minor}" if forced is not None else None


def apply_triton_arch() -> None:
    """Under the switch, set `TRITON_OVERRIDE_ARCH` for this process and the processes it starts (Inductor's
    compile workers); one already set to another capability is a ValueError naming both variables."""
    want = triton_arch()
    if want is None:
        return
    have = os.environ.setdefault(TRITON_ENV, want)
    if have != want:
        raise ValueError(f"{envvars.KERNEL_PATHS_ENV}={os.environ[envvars.KERNEL_PATHS_ENV]} needs {TRITON_ENV}={want} "
                         f"(or unset), got {TRITON_ENV}={have}")
