"""Host-side planning for `graphcap.kernels.attention.decode` (FlashInfer's split of planning from the run): the launch
configuration, the split count per capture bucket and the query-head tiling.
Everything here depends on static numbers only (shapes, the device's properties), never on GPU values. `plan_attention`
turns them into one `AttentionPlan` per bucket, on the host, before anything is traced or captured; the op takes the
plan's numbers as int arguments and calls no planner, so a planned call traces no planning (nor its lru_caches) and
the replayed graph holds the plan as constants. (A direct call that brings no plan is planned inside the op, from its
concrete inputs.)"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from graphcap.kernels.arch import GpuArch, device_arch


class AttentionError(ValueError):
    """Bad input to decode_attention; the message names the argument and what was wrong."""


@dataclass(frozen=True)
class KernelConfig:
    block_n: int = 32  # keys per tile
    num_warps: int = 4
    num_stages: int = 2
    min_chunk: int = 32  # fewest keys one split covers (rows shorter than splits x this use fewer splits)
    combine_warps: int = 4  # warps of the second (combine) kernel
    # Split adaptation (0 = off: every row uses num_splits, as tuning sweeps want): at most this many keys per
    # program before a row uses more splits than filling the GPU needs.
    max_chunk: int = 1024
    wave: int = 0  # programs the split adaptation fills (0: `target_programs` for the device and these tiles)


def default_config(head_dim: int, dtype: torch.dtype, on_gpu: bool, smem_bytes: int | None = None) -> KernelConfig:
    """The launch configuration the op uses.

    GPU values: the best or near-best configuration of the H200 sweeps (docs/results.md#attention-kernels): BLOCK_N
    32, 3 stages, 4 warps for head dims 256 and 512 (4 warps are 4-14% faster than 8 at D = 512).
    Three stages of K and V tiles need 3 x 2 x BLOCK_N x D x 2 bytes of shared memory (192 KiB at D = 512): where
    the device has less (`smem_bytes`, the current device's `arch.device_arch` when None; an A100's 163 KiB at
    D = 512), stages and then tile size step down.
    On CPU (Triton's interpreter) small tiles keep the tests fast.
    """
    if not on_gpu:
        return KernelConfig(block_n=16, num_warps=1, num_stages=1, min_chunk=16, combine_warps=1, max_chunk=64)
    warps = 4
    if smem_bytes is None:
        smem_bytes = device_arch().smem_per_block
    for block_n, stages in ((32, 3), (32, 2), (16, 2), (16, 1)):
        # at least two tiles per program: one-tile programs (32 keys) are up to 23% slower in the in-graph H200 sweep
        cfg = KernelConfig(block_n=block_n, num_warps=warps, num_stages=stages, min_chunk=2 * block_n)
        if program_smem(cfg, head_dim, dtype.itemsize) <= smem_bytes:
            break
    return cfg


def _arch(device: torch.device | None, arch: GpuArch | None) -> GpuArch:
    """`arch` where the caller describes the GPU (a CPU test of another GPU's plan), else `device`'s."""
    return arch if arch is not None else device_arch(device)


def device_sm_count(device: torch.device) -> int:
    """Multiprocessors of `device` (132 on an H200; a CPU plans as an H200, so CPU runs choose the GPU's splits;
    under GRAPHCAP_KERNEL_PATHS=sm80 an A100's 108)."""
    return device_arch(device).sm_count


def program_smem(config: KernelConfig, head_dim: int, elem_bytes: int) -> int:
    """Shared memory one split program asks for: `num_stages` K and V tiles, plus room for q and the reductions."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    return config.num_stages * 2 * config.block_n * block_d * elem_bytes + 8192


def plan_config(head_dim: int, dtype: torch.dtype, device: torch.device, arch: GpuArch | None = None) -> KernelConfig:
    """The GPU launch configuration the split plan assumes for `device` (described by `arch` where given; an H200's
    on a CPU, so CPU runs plan what the H200 would)."""
    return default_config(head_dim, dtype, True, _arch(device, arch).smem_per_block)


def target_programs(head_dim: int, dtype: torch.dtype, device: torch.device, arch: GpuArch | None = None) -> int:
    """Programs one attention call should launch to fill the GPU: two waves of the programs it holds at once
    (SMs x programs per SM, bounded by `program_smem`'s estimate of shared memory and by threads). Fitted to the
    in-graph grids on the H200 (docs/results.md#attention-kernels): at D = 512 (one 3-stage program per SM) 256
    programs are best (288: +2%, 384: +19%); at D = 256 (two per SM) 512 programs, not 256 (40.0 vs 45.5 us at batch
    8 / W = 1024).
    `arch` describes the GPU where given (else `device`'s: an H200's on a CPU)."""
    return _target_programs(head_dim, dtype, _arch(device, arch))


@functools.lru_cache(maxsize=None)
def _target_programs(head_dim: int, dtype: torch.dtype, arch: GpuArch) -> int:
    cfg = default_config(head_dim, dtype, True, arch.smem_per_block)
    per_sm = max(1, min(arch.smem_per_sm // program_smem(cfg, head_dim, dtype.itemsize), 2048 // (32 * cfg.num_warps)))
    return 2 * per_sm * arch.sm_count


def wave_splits(batch: int, kv_heads: int, programs: int = 264) -> int:
    """Splits per row that fill `programs` (`target_programs`): batch x kv_heads x splits <= programs, 1 when
    batch x kv_heads alone is within 10% of that."""
    bh, slots = batch * kv_heads, max(1, programs)
    return 1 if 10 * bh >= 9 * slots else max(1, slots // bh)


def choose_num_splits(batch: int, kv_heads: int, max_len: int, programs: int = 264, max_chunk: int = 1024,
                      min_chunk: int = 64) -> int:
    """Static split count (the grid) for `decode_attention`: depends only on static numbers, so choose it per
    capture bucket. Enough for a short row to fill the GPU (`wave_splits` of `programs`, from `target_programs`)
    and for the longest row (`max_len`: W for sliding layers, the context bound for full layers) to keep programs
    at <= `max_chunk` keys; never more than `max_len` has `min_chunk`-token chunks (the default config's, two
    tiles), at most 64. Rows use fewer at run time (see the module docstring), so a generous `max_len` costs only
    programs that exit at once.
    """
    if batch < 1 or kv_heads < 1:
        raise AttentionError(f"choose_num_splits: batch ({batch}) and kv_heads ({kv_heads}) must be >= 1")
    n = max(1, max_len)
    splits = max(wave_splits(batch, kv_heads, programs), -(-n // max(1, max_chunk)))
    return int(max(1, min(splits, -(-n // max(1, min_chunk)), 64)))


@dataclass(frozen=True)
class AttentionPlan:
    """Everything one decode-attention launch decides on the host: the split grid, the launch configuration and the
    split adaptation's wave. Made by `plan_attention`; handed to the op as ints (`launch_args`)."""

    num_splits: int  # the grid's split dimension
    block_n: int  # KernelConfig's fields the launch needs
    num_warps: int
    num_stages: int
    min_chunk: int
    max_chunk: int  # 0: no split adaptation (every row uses num_splits)
    combine_warps: int
    programs: int  # programs the split adaptation fills (`target_programs`, or the config's `wave`)
    # splits per row that fill `programs` at the planned batch (`wave_splits`); 0: planned for any batch, the split
    # kernel derives it from its grid's batch (a symbolic batch has no host value to derive it from)
    wave: int
    # the fewest splits any batch is given (`choose_num_splits` at a batch that fills the GPU alone); with it a plan
    # for any batch sizes the grid per batch (`grid_splits`). 0: the grid is always num_splits
    min_splits: int = 0

    def __post_init__(self) -> None:
        for name in ("num_splits", "block_n", "num_warps", "num_stages", "min_chunk", "combine_warps", "programs"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise AttentionError(f"AttentionPlan: {name} must be an int >= 1, got {v!r}")
        for name in ("max_chunk", "wave", "min_splits"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise AttentionError(f"AttentionPlan: {name} must be an int >= 0, got {v!r}")
        if self.min_splits > self.num_splits:
            raise AttentionError(f"AttentionPlan: min_splits ({self.min_splits}) exceeds num_splits "
                                 f"({self.num_splits})")

    def launch_args(self) -> tuple[int, ...]:
        """The op's int arguments from `num_splits` on, in its order."""
        return (self.num_splits, self.block_n, self.num_warps, self.num_stages, self.min_chunk, self.max_chunk,
                self.combine_warps, self.programs, self.wave, self.min_splits)

    def grid_splits(self, batch, kv_heads: int):
        """The split dimension of the grid for `batch` rows (an int, or a SymInt under one compile for every
        bucket): `choose_num_splits`'s count for that batch where this plan is for any batch and adapts, so the one
        compile launches each bucket's own grid (not batch 1's, whose surplus programs would only exit); else
        num_splits. Arithmetic only (sym_min / sym_max), no branch on the batch: nothing for Dynamo to guard."""
        if self.wave != 0 or self.max_chunk <= 0 or self.min_splits <= 0:
            return self.num_splits
        # wave_splits(batch) is max(1, programs // (batch x kv_heads)) (its 10% rule only ever gives that value)
        fill = torch.sym_max(1, self.programs // (batch * kv_heads))
        return torch.sym_min(self.num_splits, torch.sym_max(self.min_splits, fill))


def plan_attention(batch: int | None, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str,
                   max_len: int, *, num_splits: int | None = None, config: KernelConfig | None = None,
                   arch: GpuArch | None = None) -> AttentionPlan:
    """The plan of a decode-attention call over `batch` rows (None: any batch - num_splits is batch 1's, the most any
    batch needs, the grid's split count is then derived from the batch (`AttentionPlan.grid_splits`) and the wave
    left to the kernel) of `kv_heads` KV heads of `head_dim`, rows at most
    `max_len` keys long (W for sliding layers, the context bound for full layers). The one place the split count,
    launch configuration and wave are decided: call it per bucket, outside anything traced.

    `num_splits` overrides the split rule (`choose_num_splits`, sized by the H200's configuration on a CPU), `config`
    the launch configuration (`default_config` of the device: small tiles on a CPU, where Triton interprets).
    `arch` describes the GPU (`graphcap.kernels.arch`; default: `device`'s, an H200's on a CPU): with a "cuda"
    device and `arch` given nothing queries a GPU, so a CPU can plan for any GPU."""
    device = torch.device(device)
    on_gpu = device.type == "cuda"
    arch = _arch(device, arch)
    if config is None:
        config = default_config(head_dim, dtype, on_gpu, arch.smem_per_block if on_gpu else None)
    programs = config.wave or target_programs(head_dim, dtype, device, arch)
    if num_splits is None:
        split_cfg = plan_config(head_dim, dtype, device, arch)
        num_splits = choose_num_splits(batch or 1, kv_heads, max_len, programs, split_cfg.max_chunk,
                                       split_cfg.min_chunk)
        # a batch of `programs` rows fills the GPU alone: the rule's count where the batch asks for no more
        min_splits = choose_num_splits(max(1, programs), kv_heads, max_len, programs, split_cfg.max_chunk,
                                       split_cfg.min_chunk)
    else:  # an explicit count is every batch's
        min_splits = num_splits
    if config.max_chunk <= 0:
        wave = num_splits  # no adaptation: every row uses the whole grid
    elif batch is None:
        wave = 0
    else:  # an empty batch launches nothing; plan it as one row
        wave = min(num_splits, wave_splits(max(1, batch), kv_heads, programs))
    return AttentionPlan(num_splits=int(num_splits), block_n=config.block_n, num_warps=config.num_warps,
                         num_stages=config.num_stages, min_chunk=config.min_chunk, max_chunk=config.max_chunk,
                         combine_warps=config.combine_warps, programs=int(programs), wave=int(wave),
                         min_splits=int(min(min_splits, num_splits)))


def splits_for(q: torch.Tensor, k_pool: torch.Tensor, max_len: int) -> int:
    """The planned split count (`plan_attention`) of a call of the op on `q` [B, H, D] over `k_pool` [.., Hkv, D]
    whose rows are at most `max_len` long."""
    return plan_attention(q.shape[0], k_pool.shape[1], q.shape[-1], q.dtype, q.device, max_len).num_splits


def query_block(group: int, d: int) -> int:
    """Query heads one program holds (the GQA group padded to a tl.dot tile of >= 16 rows)."""
    block_g = max(16, triton.next_power_of_2(group))
    if block_g > 16 and (block_g > 64 or d >= 512):  # keep the [group, D] fp32 accumulator in registers
        block_g = 16 if d >= 512 else min(block_g, 64)
    return block_g
