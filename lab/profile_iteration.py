"""Where one draft iteration's GPU time goes (CUDA): per-kernel times of graphcap's compiled iteration at one
(batch, context) point, grouped by what the kernel does, beside the bytes each group must read and the replay time
of the same iteration as a CUDA graph - the breakdown behind "graphcap / roofline floor" in docs/results.md.

Kernels are timed with torch.profiler (CUPTI) on the Inductor-compiled iteration run without CUDA graphs (the same
kernels a replay runs); the graph replay is timed with CUDA events. The difference is what the graph itself adds
(gaps between kernels).

    python lab/profile_iteration.py --batch 8 --context 2048 --out DIR
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from tabulate import tabulate

from graphcap.bench.environment import environment, summary_line
from graphcap.bench.options import OneLineParser, server_compile
from graphcap.bench.roofline import draft_iteration_bytes, measure_copy_bandwidth
from graphcap.bench.state import make_target_state
from graphcap.bench.timing import median_p90, time_call
from graphcap.engine.capture import DraftGraphs
from graphcap.engine.options import CaptureOptions
from graphcap.models import DraftLoop, FrozenKVDraft
from graphcap.models.draft_ops import DEFAULT_OPS, QNORM_KERNEL_OPS, SKINNY_OPS, TORCH_OPS, TWO_HEAD_PROJ_OPS
from graphcap.spec import load_spec
from graphcap.window import WindowBuffers

INDUCTOR = "Inductor fused (norms, rope, gathers, head)"
GROUPS = (  # (group, substrings of the kernel name), first match wins; Inductor's own kernels first (group_of)
    ("attention split-KV", ("_split_kernel",)),
    ("attention combine", ("combine_kernel",)),
    ("window advance", ("window_advance", "_advance")),
    ("matmul (cuBLAS/CUTLASS, graphcap's skinny GEMM)", ("gemm", "gemv", "cutlass", "sm90_xmma", "nvjet", "splitk",
                                                          "skinny_kernel")),
    ("centroid head (graphcap's kernel)", ("_centroid_logits",)),
    ("topk / sort", ("topk", "sort", "radix")),
    ("layer small ops (graphcap's kernels)", ("_norm_rope", "_norm_add", "_rmsnorm", "_act_mul")),
    (INDUCTOR, ("triton_",)),
)


def group_of(name: str) -> str:
    """The kernel's group. Inductor names its kernels triton_<kind>_fused_<the ops in it>: by that prefix, before
    the substrings, so a fused kernel named after an op it feeds (..._skinny_linear_0) is not counted as a matmul."""
    low = name.lower()
    if low.startswith(("triton_poi_", "triton_red_", "triton_per_", "triton_tem_")):
        return INDUCTOR
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return "other"


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default="gemma4-31b-assistant")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--iters", type=int, default=20)
    sets = p.add_mutually_exclusive_group()  # the op set: graphcap's default, or one variant of it
    sets.add_argument("--skinny-gemm", action="store_true",
                      help="the projections through graphcap's skinny GEMM (SKINNY_OPS) instead of cuBLAS")
    sets.add_argument("--torch-ops", action="store_true",
                      help="the layer's norms, rotary and gelu-mul as torch ops Inductor fuses (TORCH_OPS) instead of "
                           "graphcap's kernels (the default set)")
    sets.add_argument("--qnorm-kernel", action="store_true",
                      help="the query's norm + rotary as its own kernel before the attention (QNORM_KERNEL_OPS)")
    sets.add_argument("--two-head-proj", action="store_true",
                      help="post_proj and the centroid scores as two GEMMs (TWO_HEAD_PROJ_OPS)")
    p.add_argument("--per-bucket", action="store_true",
                   help="compile for this batch alone (dynamic_batch=False) instead of the one compile for all buckets")
    p.add_argument("--inlined-layers", action="store_true",
                   help="every draft layer inlined into one graph (DraftLoop(layer_regions=False)) instead of a nested "
                        "compile region per layer")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_iteration: needs CUDA", file=sys.stderr)
        return 2
    ops = next((o for flag, o in ((a.skinny_gemm, SKINNY_OPS), (a.torch_ops, TORCH_OPS),
                                  (a.qnorm_kernel, QNORM_KERNEL_OPS), (a.two_head_proj, TWO_HEAD_PROJ_OPS)) if flag),
               DEFAULT_OPS)
    spec = load_spec(a.spec)
    b, n = a.batch, a.iters
    growth = 2 * (n + 10) * (spec.capture.steps + 1)
    state = make_target_state(spec, [a.context] * b, a.context + growth, seed=0, device="cuda")
    model = FrozenKVDraft(spec, seed=1, device="cuda")
    g = torch.Generator().manual_seed(2)
    one = torch.ones(b, dtype=torch.int32, device="cuda")  # one accepted token a row: the context stays ~constant
    tokens = torch.randint(0, spec.draft.vocab, (b,), generator=g).cuda()
    hidden = torch.randn(b, spec.target.hidden, generator=g).to("cuda", spec.torch_dtype())

    def graphs_for(backend: str) -> DraftGraphs:
        wb = WindowBuffers.from_spec(spec, state.req_to_token, state.full_to_swa)
        wb.reset(state.slots.tolist(), [a.context] * b)
        loop = DraftLoop(model, wb, state.k_swa, state.v_swa, state.k_full, state.v_full,
                         ops=ops, layer_regions=not a.inlined_layers)
        sizing = server_compile(spec, (b,), backend, a.per_bucket)
        gr = DraftGraphs.for_loop(loop, CaptureOptions(backend=backend, buckets=(b,), manifest_path=None, **sizing))
        gr.capture()
        return gr

    compiled, graphed = graphs_for("compile"), graphs_for("inductor-cudagraph")
    for _ in range(3):
        compiled.run(state.slots, one, tokens, hidden)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            compiled.run(state.slots, one, tokens, hidden)
        torch.cuda.synchronize()
    per_kernel: dict[str, list] = defaultdict(lambda: [0.0, 0])  # name -> [total us, calls]
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = per_kernel[ev.name]
            k[0] += ev.device_time
            k[1] += 1
    total_us = sum(v[0] for v in per_kernel.values()) / n
    groups: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for name, (us, calls) in per_kernel.items():
        gr = groups[group_of(name)]
        gr[0] += us / n
        gr[1] += calls / n

    replay = []
    for _ in range(3):
        graphed.run(state.slots, one, tokens, hidden)
    for _ in range(n):
        replay.append(time_call(lambda: graphed.run(state.slots, one, tokens, hidden), cuda=True).gpu_ms * 1e3)
    replay_us = median_p90(replay)[0]
    gbs = measure_copy_bandwidth()
    need = draft_iteration_bytes(spec, b, a.context)

    rows = [[grp, f"{us:.1f}", f"{calls:.0f}", f"{100 * us / total_us:.1f}"]
            for grp, (us, calls) in sorted(groups.items(), key=lambda x: -x[1][0])]
    top = sorted(per_kernel.items(), key=lambda x: -x[1][0])[:25]
    trows = [[name[:90], group_of(name), f"{us / n:.1f}", f"{calls / n:.0f}"] for name, (us, calls) in top]
    env = environment()
    floor_us = sum(need.values()) / (gbs * 1e9) * 1e6
    text = (f"# one draft iteration, kernel by kernel ({env['date']})\n\n"
            f"spec {spec.name} ({spec.hash}), batch {b}, context {a.context}, steps {spec.capture.steps}; "
            f"{summary_line(env)}\n"
            f"command: `python lab/profile_iteration.py --batch {b} --context {a.context}"
            f"{' --skinny-gemm' if a.skinny_gemm else ''}{' --torch-ops' if a.torch_ops else ''}"
            f"{' --per-bucket' if a.per_bucket else ''}{' --inlined-layers' if a.inlined_layers else ''}`\n\n"
            f"- kernel time per iteration (sum, profiler, compiled iteration without graphs): {total_us:.1f} us\n"
            f"- the same iteration as a CUDA graph replay (inductor-cudagraph, CUDA events, median of {n}): "
            f"{replay_us:.1f} us\n"
            f"- bytes it must read: " + ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in need.items()) +
            f"; copy bandwidth {gbs:.0f} GB/s -> floor {floor_us:.1f} us (replay / floor = {replay_us / floor_us:.2f})\n\n"
            + tabulate(rows, headers=["group", "us / iteration", "kernels / iteration", "% of kernel time"],
                       tablefmt="github")
            + "\n\nTop kernels:\n\n"
            + tabulate(trows, headers=["kernel", "group", "us / iteration", "calls / iteration"], tablefmt="github")
            + "\n")
    print(text)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "profile_iteration.md").write_text(text)
    (a.out / "profile_iteration.json").write_text(json.dumps(
        {"kernel_us": total_us, "replay_us": replay_us, "floor_us": floor_us, "bytes": need, "copy_gbps": gbs,
         "groups": {k: v[0] for k, v in groups.items()},
         "kernels": {k: [v[0] / n, v[1] / n] for k, v in per_kernel.items()}, "env": env}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
