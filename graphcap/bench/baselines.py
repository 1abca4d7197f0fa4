"""The sglang-style baselines: graphcap's own model and kernels, driven the way sglang drives the frozen-KV draft.

Every iteration rebuilds every row's window from `req_to_token` - the same gather-and-translate work as sglang's
`update_sliding_window_buffer`, O(batch x min(ctx, W)) - then does sglang's `seq_lens.sum().item()` host sync, then
runs the steps: eagerly (`eager-rebuild`, sglang 0.5.18 at one step) or replayed from a CUDA graph of the steps
alone (`graph-rebuild`, sglang 0.5.23). The rebuild writes the ring in the same canonical layout `advance` keeps,
so on the same state both produce exactly the tokens graphcap's loop produces.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from graphcap.capture import DraftGraphs
from graphcap.kernels.window_update import window_reset
from graphcap.models.draft_loop import DraftLoop, DraftOutput


class RebuildBaseline:
    def __init__(self, loop: DraftLoop, graphed: bool, buckets: Sequence[int] | None = None) -> None:
        self.loop = loop
        self.syncs = 0  # host syncs issued (one per iteration, as in sglang)
        self.graphs: DraftGraphs | None = None
        if graphed:
            backend = "cudagraph" if loop.window.device.type == "cuda" else "eager"
            self.graphs = DraftGraphs.for_loop(loop, backend=backend, buckets=buckets, steps_only=True,
                                               manifest_path=None, progress=False)

    @property
    def name(self) -> str:
        return "graph-rebuild" if self.graphs is not None else "eager-rebuild"

    def capture(self) -> None:
        if self.graphs is not None:
            self.graphs.capture()

    def run(self, slots: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor,
            *, host_slots: Sequence[int] | None = None) -> DraftOutput:
        w = self.loop.window
        new_lens = w.seq_lens[slots] + accepted.to(w.seq_lens.dtype)
        self.seq_lens_sum = int(new_lens.sum().item())  # sglang's per-iteration device-to-host sync
        self.syncs += 1
        window_reset(w.ring, w.seq_lens, w.req_to_token, w.full_to_swa, slots, new_lens)
        if self.graphs is not None:
            return self.graphs.run(slots, accepted, tokens, hidden, host_slots=host_slots)
        return self.loop.draft_steps(slots, accepted, tokens, hidden)


class SglangBaseline:
    """What a user gets today: the same model's steps in plain torch ops, with sglang's own Triton decode kernel
    (`decode_attention_fwd`) over CSR index lists rebuilt every iteration by sglang's own index builder
    (`create_flashinfer_kv_indices_triton`; window lists translated to SWA ids in the same pass, as in 0.5.23),
    sglang's `seq_lens.sum().item()` sync, and the steps replayed from one CUDA graph. CUDA and sglang only.

    Simplification: sglang sizes `num_kv_splits` per row from the lengths each iteration; here every row gets
    `MAX_SPLITS` (16, the best of 8/16/32 on these shapes in ../shared/notes/gpu-facts.md).
    """

    name = "sglang"
    MAX_SPLITS = 16

    def __init__(self, model, window, k_swa, v_swa, k_full, v_full, buckets: Sequence[int],
                 steps: int | None = None) -> None:
        from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
        from sglang.kernels.ops.attention.kv_indices import create_flashinfer_kv_indices_triton

        self._build_indices = create_flashinfer_kv_indices_triton
        self.window, self.syncs = window, 0
        spec, dev, bmax = model.spec, window.device, buckets[-1]
        row_len = window.req_to_token.shape[1]
        self.pools = {"sliding": (k_swa, v_swa), "full": (k_full, v_full)}
        self.indptr = {lt: torch.zeros(bmax + 1, dtype=torch.int32, device=dev) for lt in self.pools}
        self.indices = {"sliding": torch.zeros(bmax * window.window, dtype=torch.int64, device=dev),
                        "full": torch.zeros(bmax * row_len, dtype=torch.int64, device=dev)}
        self.num_kv_splits = torch.full((bmax,), self.MAX_SPLITS, dtype=torch.int32, device=dev)
        scratch = {lt: (torch.empty(bmax, spec.draft.heads, self.MAX_SPLITS, spec.attention(lt).head_dim,
                                    dtype=torch.float32, device=dev),
                        torch.empty(bmax, spec.draft.heads, self.MAX_SPLITS, dtype=torch.float32, device=dev))
                   for lt in self.pools}

        def attend_with(lt: str):
            k, v = self.pools[lt]
            logits, lse = scratch[lt]

            def attend(q: torch.Tensor, sm_scale: float) -> torch.Tensor:
                b = q.shape[0]
                o = torch.empty_like(q)
                decode_attention_fwd(q, k, v, o, self.indptr[lt][: b + 1], self.indices[lt], logits[:b], lse[:b],
                                     self.num_kv_splits[:b], self.MAX_SPLITS, sm_scale, 1.0, 1.0)
                return o
            return attend

        from graphcap.models.frozen_kv_draft import KVSource

        sources = {lt: KVSource(*self.pools[lt], window.ring if lt == "sliding" else window.req_to_token,
                                window.window if lt == "sliding" else 0, row_len, attend=attend_with(lt))
                   for lt in self.pools}
        self.loop = DraftLoop(model, window, k_swa, v_swa, k_full, v_full, steps=steps, sources=sources)
        self.graphs = DraftGraphs.for_loop(self.loop, backend="cudagraph", buckets=buckets, steps_only=True,
                                           manifest_path=None, progress=False)

    def capture(self) -> None:
        self.graphs.capture()

    def run(self, slots: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor,
            *, host_slots: Sequence[int] | None = None) -> DraftOutput:
        w, b = self.window, slots.shape[0]
        lens = w.seq_lens[slots] + accepted.to(w.seq_lens.dtype)
        w.seq_lens[slots] = lens
        self.seq_lens_sum = int(lens.sum().item())  # sglang's per-iteration device-to-host sync
        self.syncs += 1
        win = lens.clamp(max=w.window)
        for lt, n, start, mapping in (("full", lens, None, None), ("sliding", win, lens - win, w.full_to_swa)):
            ip = self.indptr[lt]
            torch.cumsum(n, 0, dtype=torch.int32, out=ip[1: b + 1])
            ip[b + 1:] = ip[b]  # padding rows of the bucket: empty
            self._build_indices[(b,)](w.req_to_token, slots, n, ip, start, self.indices[lt], w.req_to_token.stride(0),
                                      token_mapping=mapping)
        return self.graphs.run(slots, accepted, tokens, hidden, host_slots=host_slots)
