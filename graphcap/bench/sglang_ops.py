"""sglang 0.5.23's own decode-attention pieces, driven as its Triton backend drives them for the frozen-KV draft:
CSR index lists rebuilt every iteration by `create_flashinfer_kv_indices_triton` (window lists translated to SWA
locations in the same pass), per-row split counts by `get_num_kv_splits_triton` (its rule: at most
`--triton-attention-num-kv-splits` = 8, sized by the SM count and the lengths), then `decode_attention_fwd`.

The split counts as sglang has them (srt/layers/attention/triton_backend.py): one `num_kv_head` for every layer
(`TritonAttnBackend.__init__`, `model_config.get_num_kv_heads()`, which for Gemma 4 is the full layers' KV heads:
`_apply_gemma4_attention_overrides` in srt/utils/hf_transformers/config.py sets `num_key_value_heads` to them); both
plans computed per iteration (`_apply_cuda_graph_metadata`: the full rows' into `num_kv_splits`, the window rows' into
`window_num_kv_splits`); and every layer's `decode_attention_fwd` reads `forward_metadata.num_kv_splits` - the full
rows' plan, sliding layers included (`forward_decode`; nothing reads `window_num_kv_splits`). Programmatic dependent
launch as sglang sets it (`use_pdl = is_arch_support_pdl()`: compute capability >= 9 with the real sgl_kernel).

`SglangAttention(opaque=False)` calls the kernels directly (the `sglang` mode: the rebuild eager, the steps in a
CUDA graph); `opaque=True` goes through torch.library custom ops with fake implementations, so torch.compile treats
each kernel as one opaque call (the `compile` mode: the rebuild inside the compiled function). CUDA only (CPU tests
run the kernels under Triton's interpreter).
"""
from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import NamedTuple

import torch

from graphcap.models.frozen_kv_draft import KVSource
from graphcap.window import WindowBuffers

MAX_KV_SPLITS = 8  # sglang's --triton-attention-num-kv-splits default
_MODULES = {"decode": "sglang.kernels.ops.attention.decode_attention",
            "indices": "sglang.kernels.ops.attention.kv_indices",
            "splits": "sglang.kernels.ops.attention.metadata"}


class Kernels(NamedTuple):
    decode: Callable  # decode_attention_fwd
    indices: Callable  # create_flashinfer_kv_indices_triton
    splits: Callable  # get_num_kv_splits_triton


@functools.cache
def kernels() -> Kernels:
    """sglang's three kernels, imported once per process; ImportError (not cached) if absent."""
    m = {k: importlib.import_module(v) for k, v in _MODULES.items()}
    return Kernels(m["decode"].decode_attention_fwd, m["indices"].create_flashinfer_kv_indices_triton,
                   m["splits"].get_num_kv_splits_triton)


def check_available(cuda: bool) -> None:
    """Raise ImportError with the reason when sglang's kernels cannot run here."""
    if not cuda:
        raise ImportError("sglang's Triton kernels need CUDA")
    kernels()


def sglang_use_pdl(device: torch.device) -> bool:
    """sglang's `use_pdl = is_arch_support_pdl()` (TritonAttnBackend.__init__): compute capability >= 9 on CUDA, as
    with the real sgl_kernel (graphcap's test stand-in says False; sglang's engine on an H200 says True)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _build_indices(kernel: Callable, req_to_token: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor,
                   indptr: torch.Tensor, start: torch.Tensor | None, mapping: torch.Tensor | None,
                   out: torch.Tensor) -> None:
    b = slots.shape[0]
    torch.cumsum(lens, 0, dtype=torch.int32, out=indptr[1: b + 1])
    indptr[b + 1:] = indptr[b]  # the bucket's padding rows: empty lists
    kernel[(b,)](req_to_token, slots, lens, indptr, start, out, req_to_token.stride(0), token_mapping=mapping)


def _num_kv_splits(kernel: Callable, lens: torch.Tensor, out: torch.Tensor, num_head: int, num_kv_head: int,
                   cores: int) -> None:
    n = lens.shape[0]
    kernel[(1,)](out, lens, n, 1, num_head, num_kv_head, MAX_KV_SPLITS, cores,
                 MAX_NUM_SEQ=max(256, 1 << (n - 1).bit_length()))


def _decode(kernel: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indptr: torch.Tensor,
            indices: torch.Tensor, num_kv_splits: torch.Tensor, sm_scale: float, use_pdl: bool) -> torch.Tensor:
    b, h, dv = q.shape[0], q.shape[1], v.shape[-1]
    o = torch.empty(b, h, dv, dtype=q.dtype, device=q.device)
    logits = torch.empty(b, h, MAX_KV_SPLITS, dv, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, h, MAX_KV_SPLITS, dtype=torch.float32, device=q.device)
    kernel(q, k, v, o, indptr[: b + 1], indices, logits, lse, num_kv_splits[:b], MAX_KV_SPLITS, sm_scale, 1.0, 1.0,
           use_pdl=use_pdl)
    return o


# The same three calls as opaque ops for torch.compile (kernels() is resolved once; here it is a cached lookup).
@torch.library.custom_op("graphcap_bench::sglang_build_indices", mutates_args=("indptr", "out"))
def build_indices_op(req_to_token: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, indptr: torch.Tensor,
                     start: torch.Tensor | None, mapping: torch.Tensor | None, out: torch.Tensor) -> None:
    _build_indices(kernels().indices, req_to_token, slots, lens, indptr, start, mapping, out)


@build_indices_op.register_fake
def _(req_to_token, slots, lens, indptr, start, mapping, out) -> None:
    return None


@torch.library.custom_op("graphcap_bench::sglang_num_kv_splits", mutates_args=("out",))
def num_kv_splits_op(lens: torch.Tensor, out: torch.Tensor, num_head: int, num_kv_head: int, cores: int) -> None:
    _num_kv_splits(kernels().splits, lens, out, num_head, num_kv_head, cores)


@num_kv_splits_op.register_fake
def _(lens, out, num_head, num_kv_head, cores) -> None:
    return None


@torch.library.custom_op("graphcap_bench::sglang_decode", mutates_args=())
def decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
              num_kv_splits: torch.Tensor, sm_scale: float, use_pdl: bool) -> torch.Tensor:
    return _decode(kernels().decode, q, k, v, indptr, indices, num_kv_splits, sm_scale, use_pdl)


@decode_op.register_fake
def _(q, k, v, indptr, indices, num_kv_splits, sm_scale, use_pdl) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1])


class SglangAttention:
    """The per-iteration CSR metadata of both layer types (buffers sized for the largest bucket) and the attention
    that reads it, as `KVSource`s for `DraftLoop(sources=...)`."""

    def __init__(self, window: WindowBuffers, pools: dict[str, tuple[torch.Tensor, torch.Tensor]], heads: int,
                 max_batch: int, opaque: bool, cores: int | None = None) -> None:
        dev, row_len = window.device, window.req_to_token.shape[1]
        self.window, self.pools, self.heads = window, pools, heads
        # sglang's one num_kv_head for every layer's plan: the full layers' (see the module docstring)
        self.kv_heads = pools["full"][0].shape[1]
        # the SM count, as sglang's get_device_core_count (`cores` for a CPU test under Triton's interpreter)
        self.cores = cores or torch.cuda.get_device_properties(dev).multi_processor_count
        self.use_pdl = sglang_use_pdl(dev)
        self.indptr = {lt: torch.zeros(max_batch + 1, dtype=torch.int32, device=dev) for lt in pools}
        # int64 locations, as sglang's triton backend builds them (its kernel multiplies them by the pool's row
        # stride without widening)
        self.indices = {"sliding": torch.zeros(max_batch * window.window, dtype=torch.int64, device=dev),
                        "full": torch.zeros(max_batch * row_len, dtype=torch.int64, device=dev)}
        # "full": sglang's num_kv_splits, read by every layer's decode; "sliding": its window_num_kv_splits, computed
        # every iteration as sglang does (one launch) and read by nothing, as in sglang
        self.splits = {lt: torch.full((max_batch,), MAX_KV_SPLITS, dtype=torch.int32, device=dev) for lt in pools}
        k = kernels()  # resolved once, here: no imports on the per-iteration path
        if opaque:
            self.build, self.plan, self.decode = build_indices_op, num_kv_splits_op, decode_op
        else:
            self.build = functools.partial(_build_indices, k.indices)
            self.plan = functools.partial(_num_kv_splits, k.splits)
            self.decode = functools.partial(_decode, k.decode)

    def static_tensors(self) -> dict[str, torch.Tensor]:
        out = {f"sglang.indptr.{lt}": t for lt, t in self.indptr.items()}
        out.update({f"sglang.indices.{lt}": t for lt, t in self.indices.items()})
        out.update({f"sglang.splits.{lt}": t for lt, t in self.splits.items()})
        return out

    def rebuild(self, slots: torch.Tensor, lens: torch.Tensor) -> None:
        """Both layer types' index lists and split counts for rows of `lens` tokens (after this iteration's
        accepted tokens): full layers the whole row, sliding layers its last min(len, W) tokens, translated. Both
        plans with the full layers' KV heads: sglang's one `num_kv_head` (triton_backend.py
        `TritonAttnBackend.__init__`; Gemma 4's via `_apply_gemma4_attention_overrides`)."""
        w = self.window
        win = lens.clamp(max=w.window)
        for lt, n, start, mapping in (("full", lens, None, None), ("sliding", win, lens - win, w.full_to_swa)):
            self.build(w.req_to_token, slots, n, self.indptr[lt], start, mapping, self.indices[lt])
            self.plan(n, self.splits[lt], self.heads, self.kv_heads, self.cores)

    def decode_splits(self, layer_type: str) -> torch.Tensor:
        """The split counts a layer's decode reads: the full rows' plan for both types, as sglang's
        `TritonAttnBackend.forward_decode` passes `forward_metadata.num_kv_splits` to every layer."""
        return self.splits["full"]

    def sources(self) -> dict[str, KVSource]:
        w = self.window
        out = {}
        for lt, (k, v) in self.pools.items():
            def attend(q: torch.Tensor, sm_scale: float, lt: str = lt, k: torch.Tensor = k, v: torch.Tensor = v,
                       splits: torch.Tensor = self.decode_splits(lt)) -> torch.Tensor:
                return self.decode(q, k, v, self.indptr[lt], self.indices[lt], splits, sm_scale, self.use_pdl)

            table, window = (w.ring, w.window) if lt == "sliding" else (w.req_to_token, 0)
            out[lt] = KVSource(k, v, table, window, w.req_to_token.shape[1], attend=attend)
        return out
