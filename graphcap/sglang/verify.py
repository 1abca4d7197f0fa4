"""graphcap's verify attention in sglang's target verify (`--draft-graph-verify-attention graphcap`).

sglang's Triton backend runs a target verify through its prefill kernel `extend_attention_fwd` on NVIDIA, which walks
each request's whole prefix serially per query head; graphcap's split-KV verify kernel
(`graphcap.kernels.attention.verify`) reads each K/V tile once for every query head and verify token of a KV head and
splits the prefix across the GPU. sglang already has a seat for such a kernel: `TritonAttnBackend.forward_extend`
calls `self.verify_splitkv_fwd(...)` with `extend_attention_fwd`'s own arguments for a target verify when
`self.use_verify_splitkv` is set (sglang turns it on for AMD gfx95 only), and falls back to `extend_attention_fwd`
when that call returns False. graphcap takes that seat on the target's backend (an AFTER hook on the backend's
`__init__`); every case it does not serve exactly - a non-causal or tree mask, attention sinks, a logit cap, fp8 K/V
scales, unequal verify lengths - returns False and runs sglang's kernel as before.

The verify's index lists are still sglang's (its backend refills `kv_indices` / `window_kv_indices` before each
verify replay); the kernel reads them in place. Called while sglang records its verify CUDA graphs, so the plan is
made then, once per bucket and layer kind, from static numbers; replays run the recorded kernels.
"""
from __future__ import annotations

import logging
from collections import Counter

import torch

from graphcap.kernels.attention.verify import MAX_QUERY_TOKENS, VerifyPlan, plan_verify, verify_attention

log = logging.getLogger("graphcap.sglang")
SEAT_ATTR = "_graphcap_verify_attention"  # on the target's TritonAttnBackend: the installed seat (tests read it)


class VerifyAttentionSeat:
    """Callable in the place of sglang's `verify_splitkv_fwd`: True when graphcap's kernel wrote `o`, False (nothing
    written) for a case it leaves to sglang's `extend_attention_fwd`."""

    def __init__(self, max_context_len: int) -> None:
        self.max_context_len = int(max_context_len)
        self.plans: dict[tuple, VerifyPlan] = {}
        self.served = 0  # calls run by graphcap's kernel (host calls: a captured graph's replays are not counted)
        self.declined: Counter[str] = Counter()  # calls left to sglang, by reason

    @staticmethod
    def declines(q, k, v, o, k_buffer, v_buffer, qo_indptr, custom_mask, causal, max_extend_len, k_descale,
                 v_descale, logit_cap, sinks, xai_temperature_len) -> str | None:
        """Why graphcap's kernel would not give what sglang's extend kernel gives here, or None."""
        if not causal:
            return "non-causal attention"
        if sinks is not None:
            return "attention sinks"
        if logit_cap:
            return "a logit cap"
        if xai_temperature_len is not None and xai_temperature_len > 0:
            return "xai temperature scaling"
        if k_descale != 1.0 or v_descale != 1.0 or k_buffer.dtype != q.dtype or v_buffer.dtype != q.dtype:
            return "scaled or narrower K/V (fp8)"
        if q.shape[-1] != o.shape[-1] or k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
            return "different query and value head dims"
        n_q = int(max_extend_len)
        if not 1 <= n_q <= MAX_QUERY_TOKENS or q.shape[0] != (qo_indptr.shape[0] - 1) * n_q:
            return "verify lengths not all equal to max_extend_len"
        if custom_mask is not None and custom_mask.dtype not in (torch.bool, torch.uint8, torch.int8):
            return "a custom mask of another kind"  # topk > 1 is refused at start-up; the chain's mask is causal
        return None

    def __call__(self, q, k, v, o, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, causal,
                 mask_indptr, max_extend_len, k_descale, v_descale, sm_scale, logit_cap=0.0, sliding_window_size=-1,
                 sinks=None, window_kv_offsets=None, xai_temperature_len=-1, **_) -> bool:
        why = self.declines(q, k, v, o, k_buffer, v_buffer, qo_indptr, custom_mask, causal, max_extend_len,
                            k_descale, v_descale, logit_cap, sinks, xai_temperature_len)
        if why is not None:
            if why not in self.declined:
                log.info("graphcap: a verify with %s runs sglang's extend kernel", why)
            self.declined[why] += 1
            return False
        n_q = int(max_extend_len)
        window = int(sliding_window_size) if sliding_window_size is not None and sliding_window_size > 0 else 0
        batch, h, d = qo_indptr.shape[0] - 1, q.shape[1], q.shape[2]
        hkv = k_buffer.shape[1]
        key = (batch, n_q, h, hkv, d, window, q.dtype, q.device)
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = plan_verify(batch, hkv, h, d, n_q, q.dtype, q.device,
                                                 window or self.max_context_len)
        verify_attention(q, k, v, k_buffer, v_buffer, kv_indptr, kv_indices, n_q, float(sm_scale), window,
                         plan=plan, out=o)
        self.served += 1
        return True


def serves(backend, model_runner) -> bool:
    """Whether graphcap's verify seat can go on this TritonAttnBackend of `model_runner`: the target's (not a
    draft's), a topk-1 chain (graphcap's start-up check refuses other trees), no MLA, no deterministic or DCP path in
    front of the seat."""
    if getattr(model_runner, "is_draft_worker", True):
        return False
    if getattr(backend, "topk", 1) != 1 or getattr(backend, "use_mla", False):
        return False
    if getattr(backend, "enable_deterministic", False) or getattr(backend, "dcp_size", 1) != 1:
        return False
    return hasattr(backend, "use_verify_splitkv") and hasattr(backend, "max_context_len")


def install(backend, model_runner) -> VerifyAttentionSeat | None:
    """Seat graphcap's verify kernel on `backend` (a TritonAttnBackend of `model_runner`) if it `serves`; returns the
    seat or None."""
    if not serves(backend, model_runner):
        return None
    seat = VerifyAttentionSeat(backend.max_context_len)
    # torch.compiler.disable as sglang wraps its own: a compiled caller calls the launch eagerly, not traced
    backend.verify_splitkv_fwd = torch.compiler.disable(seat)
    backend.use_verify_splitkv = True
    backend.use_verify_shared_kv = False  # the grouped-head seat sglang checks first (gfx95 only) stays empty
    setattr(backend, SEAT_ATTR, seat)
    log.info("graphcap: the target's verify attention runs graphcap's split-KV verify kernel")
    return seat
