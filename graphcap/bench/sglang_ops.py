"""sglang 0.5.23's own decode-attention pieces, driven as its Triton backend drives them for the frozen-KV draft:
CSR index lists rebuilt every iteration by `create_flashinfer_kv_indices_triton` (window lists translated to SWA
locations in the same pass), per-row split counts by `get_num_kv_splits_triton` (its rule: at most
`--triton-attention-num-kv-splits` = 8, sized by the SM count and the lengths), then `decode_attention_fwd`.

`SglangAttention(opaque=False)` calls the kernels directly (the `sglang` mode: the rebuild eager, the steps in a
CUDA graph); `opaque=True` goes through torch.library custom ops with fake implementations, so torch.compile treats
each kernel as one opaque call (the `compile` mode: the rebuild inside the compiled function). CUDA only.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from graphcap.models.frozen_kv_draft import KVSource
from graphcap.window import WindowBuffers

MAX_KV_SPLITS = 8  # sglang's --triton-attention-num-kv-splits default
_MODULES = {"decode": "sglang.kernels.ops.attention.decode_attention",
            "indices": "sglang.kernels.ops.attention.kv_indices",
            "splits": "sglang.kernels.ops.attention.metadata"}


def _kernels() -> tuple[Callable, Callable, Callable]:
    """(decode_attention_fwd, create_flashinfer_kv_indices_triton, get_num_kv_splits_triton); ImportError if absent."""
    m = {k: importlib.import_module(v) for k, v in _MODULES.items()}
    return (m["decode"].decode_attention_fwd, m["indices"].create_flashinfer_kv_indices_triton,
            m["splits"].get_num_kv_splits_triton)


def check_available(cuda: bool) -> None:
    """Raise ImportError with the reason when sglang's kernels cannot run here."""
    if not cuda:
        raise ImportError("sglang's Triton kernels need CUDA")
    _kernels()


def _build_indices(req_to_token: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, indptr: torch.Tensor,
                   start: torch.Tensor | None, mapping: torch.Tensor | None, out: torch.Tensor) -> None:
    b = slots.shape[0]
    torch.cumsum(lens, 0, dtype=torch.int32, out=indptr[1: b + 1])
    indptr[b + 1:] = indptr[b]  # the bucket's padding rows: empty lists
    _kernels()[1][(b,)](req_to_token, slots, lens, indptr, start, out, req_to_token.stride(0), token_mapping=mapping)


def _num_kv_splits(lens: torch.Tensor, out: torch.Tensor, num_head: int, num_kv_head: int, cores: int) -> None:
    n = lens.shape[0]
    _kernels()[2][(1,)](out, lens, n, 1, num_head, num_kv_head, MAX_KV_SPLITS, cores,
                        MAX_NUM_SEQ=max(256, 1 << (n - 1).bit_length()))


def _decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
            num_kv_splits: torch.Tensor, sm_scale: float) -> torch.Tensor:
    b, h, dv = q.shape[0], q.shape[1], v.shape[-1]
    o = torch.empty(b, h, dv, dtype=q.dtype, device=q.device)
    logits = torch.empty(b, h, MAX_KV_SPLITS, dv, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, h, MAX_KV_SPLITS, dtype=torch.float32, device=q.device)
    _kernels()[0](q, k, v, o, indptr[: b + 1], indices, logits, lse, num_kv_splits[:b], MAX_KV_SPLITS, sm_scale,
                  1.0, 1.0)
    return o


# The same three calls as opaque ops for torch.compile.
@torch.library.custom_op("graphcap_bench::sglang_build_indices", mutates_args=("indptr", "out"))
def build_indices_op(req_to_token: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, indptr: torch.Tensor,
                     start: torch.Tensor | None, mapping: torch.Tensor | None, out: torch.Tensor) -> None:
    _build_indices(req_to_token, slots, lens, indptr, start, mapping, out)


@build_indices_op.register_fake
def _(req_to_token, slots, lens, indptr, start, mapping, out) -> None:
    return None


@torch.library.custom_op("graphcap_bench::sglang_num_kv_splits", mutates_args=("out",))
def num_kv_splits_op(lens: torch.Tensor, out: torch.Tensor, num_head: int, num_kv_head: int, cores: int) -> None:
    _num_kv_splits(lens, out, num_head, num_kv_head, cores)


@num_kv_splits_op.register_fake
def _(lens, out, num_head, num_kv_head, cores) -> None:
    return None


@torch.library.custom_op("graphcap_bench::sglang_decode", mutates_args=())
def decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
              num_kv_splits: torch.Tensor, sm_scale: float) -> torch.Tensor:
    return _decode(q, k, v, indptr, indices, num_kv_splits, sm_scale)


@decode_op.register_fake
def _(q, k, v, indptr, indices, num_kv_splits, sm_scale) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1])


class SglangAttention:
    """The per-iteration CSR metadata of both layer types (buffers sized for the largest bucket) and the attention
    that reads it, as `KVSource`s for `DraftLoop(sources=...)`."""

    def __init__(self, window: WindowBuffers, pools: dict[str, tuple[torch.Tensor, torch.Tensor]], heads: int,
                 max_batch: int, opaque: bool, cores: int | None = None) -> None:
        dev, row_len = window.device, window.req_to_token.shape[1]
        self.window, self.pools, self.heads = window, pools, heads
        # the SM count, as sglang's get_device_core_count (`cores` for a CPU test under Triton's interpreter)
        self.cores = cores or torch.cuda.get_device_properties(dev).multi_processor_count
        self.indptr = {lt: torch.zeros(max_batch + 1, dtype=torch.int32, device=dev) for lt in pools}
        # int64 locations, as sglang's triton backend builds them (its kernel multiplies them by the pool's row
        # stride without widening)
        self.indices = {"sliding": torch.zeros(max_batch * window.window, dtype=torch.int64, device=dev),
                        "full": torch.zeros(max_batch * row_len, dtype=torch.int64, device=dev)}
        self.splits = {lt: torch.full((max_batch,), MAX_KV_SPLITS, dtype=torch.int32, device=dev) for lt in pools}
        self.build, self.plan, self.decode = ((build_indices_op, num_kv_splits_op, decode_op) if opaque
                                              else (_build_indices, _num_kv_splits, _decode))

    def static_tensors(self) -> dict[str, torch.Tensor]:
        out = {f"sglang.indptr.{lt}": t for lt, t in self.indptr.items()}
        out.update({f"sglang.indices.{lt}": t for lt, t in self.indices.items()})
        out.update({f"sglang.splits.{lt}": t for lt, t in self.splits.items()})
        return out

    def rebuild(self, slots: torch.Tensor, lens: torch.Tensor) -> None:
        """Both layer types' index lists and split counts for rows of `lens` tokens (after this iteration's
        accepted tokens): full layers the whole row, sliding layers its last min(len, W) tokens, translated."""
        w = self.window
        win = lens.clamp(max=w.window)
        for lt, n, start, mapping in (("full", lens, None, None), ("sliding", win, lens - win, w.full_to_swa)):
            self.build(w.req_to_token, slots, n, self.indptr[lt], start, mapping, self.indices[lt])
            self.plan(n, self.splits[lt], self.heads, self.pools[lt][0].shape[1], self.cores)

    def sources(self) -> dict[str, KVSource]:
        w = self.window
        out = {}
        for lt, (k, v) in self.pools.items():
            def attend(q: torch.Tensor, sm_scale: float, lt: str = lt, k: torch.Tensor = k,
                       v: torch.Tensor = v) -> torch.Tensor:
                return self.decode(q, k, v, self.indptr[lt], self.indices[lt], self.splits[lt], sm_scale)

            table, window = (w.ring, w.window) if lt == "sliding" else (w.req_to_token, 0)
            out[lt] = KVSource(k, v, table, window, w.req_to_token.shape[1], attend=attend)
        return out
