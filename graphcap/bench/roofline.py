"""The bandwidth floor of one draft iteration: the bytes it must read (weights once per step, the K/V of every
row's window and full context once per layer and step, the LM-head rows it scores) over the copy bandwidth measured
on the same GPU. Arithmetic is far below the H200's matrix rate at these batch sizes, so bytes set the floor."""
from __future__ import annotations

from graphcap.spec import CaptureSpec

_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def draft_iteration_bytes(spec: CaptureSpec, batch: int, context: int, steps: int | None = None) -> dict[str, int]:
    steps = steps or spec.capture.steps
    e = _BYTES[spec.dtype]
    d = spec.draft
    layer_params = 0
    for lt in d.layers:
        a = spec.attention(lt)
        layer_params += 2 * d.heads * a.head_dim * d.hidden + 3 * d.intermediate * d.hidden  # q, o; gate, up, down
    params = layer_params + 3 * spec.target.hidden * d.hidden  # pre (2 x target) + post projection
    if d.head == "centroid":
        params += d.centroids * d.hidden
        head_rows = batch * d.centroid_top_k * (d.vocab // d.centroids)  # each row scores its own clusters
    else:
        head_rows = d.vocab
    kv = {"sliding": 0, "full": 0}
    for lt in d.layers:
        a = spec.attention(lt)
        tokens = min(context, spec.window) if lt == "sliding" else context
        kv[lt] += batch * tokens * a.kv_heads * a.head_dim * 2 * e  # K and V
    return {"weights": steps * params * e, "lm_head_rows": steps * min(head_rows, d.vocab) * d.hidden * e,
            "kv_sliding": steps * kv["sliding"], "kv_full": steps * kv["full"]}


def floor_ms(spec: CaptureSpec, batch: int, context: int, steps: int, copy_gb_s: float) -> float:
    return sum(draft_iteration_bytes(spec, batch, context, steps).values()) / (copy_gb_s * 1e9) * 1e3


def measure_copy_bandwidth(gib: float = 2.0) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus written (CUDA only)."""
    import torch
    import triton

    n = int(gib * 2**30) // 4
    src = torch.empty(n, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * n * 4 / (ms * 1e-3) / 1e9
