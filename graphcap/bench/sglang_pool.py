"""sglang's hybrid sliding-window KV pool as arithmetic, for a case that does not fit: the KV bytes a token takes in
the full-attention and the sliding-window layers (from the target's config, as bench/sglang_checkpoint.py writes it),
and the `--swa-full-tokens-ratio` that would hold a batch in the memory an engine's pool already has.

With the radix cache on sglang sizes both pools from one budget: `full` tokens of the full-attention layers and
`ratio x full` of the sliding-window layers, so `full x (full_bytes + ratio x sliding_bytes)` bytes. A lower ratio
moves bytes to the full-attention pool (a long context's whole prefix) from the sliding one (only each running
request's window and the prefill chunk in flight). The budget is what the engine got - the weights, the draft's and
CUDA graphs' memory already taken - so it is read from the engine's own pool, not estimated."""
from __future__ import annotations

import math
from dataclasses import dataclass

KV_ELEM_BYTES = 2  # bf16 K/V (sglang's kv_cache_dtype "auto" on a bf16 model, the W8A8 target's too)
PAGE = 64  # the harness's page size: a request's window ends on a page
MARGIN = 1.1  # a lower ratio's pool came out 4% smaller than the budget gives (W8A8 target, H100): aim above


@dataclass(frozen=True)
class PoolShape:
    full_bytes: int  # K/V bytes per token over all full-attention layers
    sliding_bytes: int  # over all sliding-window layers
    window: int


def pool_shape(config: dict) -> PoolShape | None:
    """The target's per-token KV bytes by layer kind; None where the config does not say (another layout)."""
    types = config.get("layer_types")
    try:
        full = types.count("full_attention") * config["num_key_value_heads"] * (
            config["head_dim"] + config.get("v_head_dim", config["head_dim"]))
        sliding = types.count("sliding_attention") * config["swa_num_key_value_heads"] * (
            config["swa_head_dim"] + config.get("swa_v_head_dim", config["swa_head_dim"]))
        window = int(config["sliding_window"])
    except (AttributeError, KeyError, TypeError):
        return None
    return PoolShape(full * KV_ELEM_BYTES, sliding * KV_ELEM_BYTES, window)


def ratio_advice(shape: PoolShape, pool: int, ratio: float, need: int, batch: int, chunk: int) -> str:
    """What would hold `need` full-attention tokens at once for `batch` requests, given an engine whose full pool
    holds `pool` tokens at `ratio` and prefills `chunk` tokens at a time: a lower ratio, where the sliding pool
    left still holds each request's window and a chunk; else more memory."""
    budget = pool * (shape.full_bytes + ratio * shape.sliding_bytes)
    per_token = budget / (need * MARGIN)
    r = min(1.0, math.floor((per_token - shape.full_bytes) / shape.sliding_bytes * 100) / 100)  # sglang's bound: 1
    windows = batch * (shape.window + PAGE) + chunk
    if r >= 0.01:
        full = budget / (shape.full_bytes + r * shape.sliding_bytes)
        if r * full >= windows:
            return (f"about --swa-full-tokens-ratio {r:.2f} would hold them: this pool's {budget / 2**30:.1f} GiB "
                    f"as ~{full:.0f} full-attention and ~{r * full:.0f} sliding-window tokens")
    return (f"no --swa-full-tokens-ratio holds them in this pool's {budget / 2**30:.1f} GiB beside the "
            f"{windows} sliding-window tokens {batch} windows and a {chunk}-token chunk take: more memory "
            "(--mem-fraction) or a smaller --chunked-prefill-size")
