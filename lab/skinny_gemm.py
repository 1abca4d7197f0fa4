"""The draft's matmuls at small batch: graphcap's skinny GEMM (every candidate config and the plan's choice) against
cuBLAS and Inductor's max-autotune, per Gemma 4 assistant shape and M in 1..64, in GB/s against copy bandwidth.

Contestants per (shape, M), all bf16 with fp32 accumulation:
- cublas: `x @ w.t()`; for gate_up, `x @ w.t()` then graphcap's gelu_tanh_and_mul kernel (two kernels, or more
  where cuBLAS splits K) - what the draft runs today.
- inductor: torch.compile(mode="max-autotune-no-cudagraphs") of the same expression (gate_up: chunk, gelu-tanh, mul).
- plan: graphcap.kernels.gemm.skinny's registered op (the config `plan` picks); <config>: each candidate of the
  shape's class through `launch` (with --grid: every config of `grid_configs` instead, a wider search than the
  table's candidates - tiles, warps, pipeline depths, CUDA-core configs and, for the narrow shapes, split counts;
  with --configs: the configs named, e.g. n16k256s1w4st8,n64k128s4w4st5-fixup).
- with --ceiling, two kernels that read the weights and compute nothing from them (each program sums its tiles;
  `read` by per-thread loads, `read-tma` by the Tensor Memory Accelerator), over the plan's tiles, grid and pipeline
  depth (gate/up: its gate and up rows in programs of their own): what one kernel streaming these bytes takes in
  this position (its launch, its pipeline's fill and drain included), a per-kernel floor nearer the truth than copy
  bandwidth. They are not GEMMs: never checked against cublas, never a "best of ours". With --read-grids, `read`
  also runs over other grids (`read@<config>`: that config's tiles, split and depth; `sweep`: `read_grid_configs`),
  to tell a limit of this kernel's grid from one of any kernel reading these bytes.
Each contestant's output is checked against cublas first (max |a - b| / max |b|, printed); one above 2e-2 is
reported and not timed.

Timing: one CUDA graph holds R calls, each on its own copy of the weights, the copies together >= 256 MB (the
H200's L2 is 50 MB), so every call reads its weights from HBM with a clean L2, back to back as in the draft's graph
(the gap between kernels, and split-K's extra kernels, count). Time per call = median replay time (CUDA events) / R.
GB/s = (weights + x + out bytes) / time, against the device-to-device copy bandwidth measured in the same run
(graphcap.bench.roofline, bytes read + written).

    python lab/skinny_gemm.py --out DIR [--quick] [--grid | --configs NAMES] [--ceiling] [--read-grids NAMES|sweep]
    # CUDA only; writes skinny_gemm.{json,md} into DIR
"""
from __future__ import annotations

import json
import math
import random
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from tabulate import tabulate
from triton.tools.tensor_descriptor import TensorDescriptor

from graphcap.bench import environment as bench_env
from graphcap.bench import timing
from graphcap.bench.options import OneLineParser

if TYPE_CHECKING:
    from graphcap.kernels.gemm.skinny import Config

# name: (N, K, gated); gated N is I, the output width (w is [2I, K]). post_proj is the draft's other matmul;
# head_proj is post_proj and the centroids stacked, as graphcap's loop runs them (one GEMM, merge_head_proj).
SHAPES = {"q_proj_sliding": (8192, 1536, False), "q_proj_full": (16384, 1536, False),
          "o_proj_sliding": (1536, 8192, False), "o_proj_full": (1536, 16384, False), "gate_up": (6144, 1536, True),
          "down": (1536, 6144, False), "pre_proj": (1536, 10752, False), "centroids": (2048, 1536, False),
          "post_proj": (5376, 1536, False), "head_proj": (5376 + 2048, 1536, False)}
MS = (1, 2, 4, 8, 16, 32, 64)
ROTATE_BYTES = 256 << 20  # weight copies per graph: together >> the 50 MB L2
MAX_ERR = 2e-2
CEILINGS = ("read", "read-tma")


@triton.jit
def _read_kernel(w, out, K, k_split, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                 TMA: tl.constexpr):
    """out[n-block, split] = the sum of program (n-block, split)'s weight tiles: the skinny GEMM's reads (its grid,
    tiles and pipeline depth; w's N and K multiples of the tile) without its product."""
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    n0 = pid_n * BLOCK_N
    if not TMA:
        w_ptr = (w + (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)[:, None] * stride_wn
                 + tl.arange(0, BLOCK_K)[None, :])
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    k0 = pid_s * k_split
    # an explicit depth: Triton pipelines a loop's loads on its own only where they feed a tl.dot
    for k in tl.range(k0, tl.minimum(k0 + k_split, K), BLOCK_K, num_stages=STAGES):
        acc += (w.load([n0, k]) if TMA else tl.load(w_ptr + k)).to(tl.float32)
    tl.store(out + pid_n * tl.num_programs(1) + pid_s, tl.sum(tl.sum(acc, 1), 0))


def read_sums(w: torch.Tensor, cfg: Config, tma: bool) -> torch.Tensor:
    """`_read_kernel` over w [N, K] with cfg's grid: [N / block_n, splits] fp32 sums of each program's tiles."""
    from graphcap.kernels.gemm import skinny as sg

    n, k = w.shape
    if n % cfg.block_n or k % cfg.block_k:
        raise ValueError(f"read_sums: w {tuple(w.shape)} is not whole tiles of {cfg.block_n} x {cfg.block_k}")
    k_split, splits = sg.k_splits(k, cfg)
    out = torch.empty((n // cfg.block_n, splits), dtype=torch.float32, device=w.device)
    w_arg = TensorDescriptor(w, list(w.shape), list(w.stride()), [cfg.block_n, cfg.block_k]) if tma else w
    _read_kernel[out.shape](w_arg, out, k, k_split, w.stride(0), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                            STAGES=cfg.num_stages, TMA=tma, num_warps=cfg.num_warps)
    return out


def read_sums_torch(w: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Twin of read_sums: the same blocks' sums in float64."""
    from graphcap.kernels.gemm import skinny as sg

    n, k = w.shape
    k_split, splits = sg.k_splits(k, cfg)
    blocks = w.double().reshape(n // cfg.block_n, cfg.block_n, k)
    return torch.stack([blocks[:, :, s * k_split:(s + 1) * k_split].sum((1, 2)) for s in range(splits)], dim=1)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def graph_us(fn: Callable[[torch.Tensor], torch.Tensor], ws: list[torch.Tensor], rep_ms: float) -> float:
    """Microseconds per call: one graph of len(ws) calls, one per weight copy (module docstring)."""
    for w in ws:  # compile / autotune / warm outside the capture
        fn(w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in ws:
            fn(w)
    ms = timing.events_ms(graph.replay, rep_ms)
    del graph
    return ms * 1e3 / len(ws)


def grid_configs(m: int, n: int, k: int, gated: bool) -> tuple[Config, ...]:
    """The --grid search for one shape: tensor-core configs over tiles x warps x pipeline depths, CUDA-core (broadcast)
    configs up to 4 rows, and for the narrow (split-K) shapes each with 4, 8 and 16 splits summed in the kernel -
    whatever fits the shared memory (`pipeline_smem`) and leaves no split empty. The shape class's own candidates
    come first (the table's configs are timed in the same run), the rest in a fixed shuffled order: a run cut by its
    budget has sampled the whole grid evenly rather than its first corner."""
    from graphcap.kernels.gemm import skinny as sg

    narrow = not gated and n < sg.NARROW_N
    splits = (4, 8, 16) if narrow else (1,)
    dot = [sg.Config(bn, bk, s, nw, ns, fixup=s > 1) for bn, bk in ((16, 256), (16, 512), (32, 128), (32, 256),
                                                                     (64, 64), (64, 128), (64, 256), (128, 64),
                                                                     (128, 128))
           for nw in (4, 8) for ns in (2, 3, 5) for s in splits]
    bcast = [sg.Config(bn, bk, s, nw, ns, dot=False, fixup=s > 1)
             for bn, bk in ((16, 256), (32, 128), (32, 256), (64, 128)) for nw in (4, 8) for ns in (1, 2, 3)
             for s in splits] if m <= 4 else []
    fits = [c for c in dot + bcast if k >= c.split_k * c.block_k
            and not (c.dot and sg.pipeline_smem(c, m, gated) > sg.SMEM_LIMIT)]
    random.Random(0).shuffle(fits)
    return tuple(dict.fromkeys(sg.candidates(m, n, k, gated) + tuple(fits)))


def read_grid_configs(n: int, k: int, gated: bool) -> tuple[Config, ...]:
    """--read-grids sweep for one shape: the read kernel's tiles x splits x warps x depths over whole tiles, from a
    quarter of a wave to 16 waves of 132 programs (the read kernel ignores M, so one sweep per shape)."""
    from graphcap.kernels.gemm import skinny as sg

    rows = 2 * n if gated else n
    out = []
    for bn, bk in ((16, 256), (32, 128), (32, 256), (64, 64), (64, 128), (128, 64)):
        for split in (1, 2, 4, 8, 16):
            for nw in (4, 8):
                for ns in (3, 5):
                    cfg = sg.Config(bn, bk, split, nw, ns)
                    if rows % bn or k % bk or sg.k_splits(k, cfg)[1] != split:
                        continue
                    if 33 <= rows // bn * split <= 16 * 132:
                        out.append(cfg)
    return tuple(out)


def parse_config(name: str) -> Config:
    """The Config whose `name` is `name` (n<block_n>k<block_k>s<split_k>w<warps>st<stages>[-bcast|-gemv][-fixup])."""
    from graphcap.kernels.gemm import skinny as sg

    hit = re.fullmatch(r"n(\d+)k(\d+)s(\d+)w(\d+)st(\d+)(-bcast|-gemv)?(-fixup)?", name)
    if hit is None:
        raise ValueError(f"not a config name: {name!r} (expected e.g. n64k128s4w4st5-fixup)")
    bn, bk, split, warps, stages = (int(v) for v in hit.groups()[:5])
    if min(bn, bk, split, warps, stages) < 1 or any(v & (v - 1) for v in (bn, bk, warps)):
        raise ValueError(f"config {name!r}: tiles and warps must be powers of two, every count >= 1")
    return sg.Config(bn, bk, split, warps, stages, dot=hit[6] is None, fixup=hit[7] is not None,
                     gemv=hit[6] == "-gemv")


def contestants(x: torch.Tensor, gated: bool, n: int, inductor: bool, wide_grid: bool = False,
                ceiling: bool = False, configs: tuple[Config, ...] | None = None,
                read_grids: tuple[Config, ...] = ()) -> dict[str, Callable]:
    from graphcap.kernels.gemm import skinny as sg
    from graphcap.kernels.elementwise.fused_ops import gelu_tanh_and_mul

    def expr(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if not gated:
            return x @ w.t()
        g, u = (x @ w.t()).chunk(2, dim=-1)
        return torch.nn.functional.gelu(g, approximate="tanh") * u

    m, k = x.shape
    fns: dict[str, Callable] = {
        "cublas": (lambda w: gelu_tanh_and_mul(x @ w.t())) if gated else (lambda w: x @ w.t()),
        "plan": (lambda w: sg.skinny_gate_up_gelu(x, w)) if gated else (lambda w: sg.skinny_linear(x, w)),
    }
    if inductor:
        compiled = torch.compile(expr, mode="max-autotune-no-cudagraphs", dynamic=False, fullgraph=True)
        fns["inductor"] = lambda w: compiled(x, w)
    for cfg in configs if configs is not None else (grid_configs if wide_grid else sg.candidates)(m, n, k, gated):
        fns[cfg.name] = lambda w, cfg=cfg: sg.launch(x, w, x.new_empty(m, n), cfg, gated)
    if ceiling:
        plan = sg.plan(m, n, k, gated)
        for name in CEILINGS:
            fns[name] = lambda w, tma=name.endswith("tma"): read_sums(w, plan, tma)
    for cfg in read_grids:
        fns[f"read@{cfg.name}"] = lambda w, cfg=cfg: read_sums(w, cfg, False)
    return fns


def is_read(contestant: str) -> bool:
    """A read-only kernel (--ceiling, --read-grids): never a GEMM result."""
    return contestant in CEILINGS or contestant.startswith("read@")


def measure(name: str, m: int, ws: list[torch.Tensor], x: torch.Tensor, gated: bool, n: int, rep_ms: float,
            copy_gbs: float, which: set[str] | None, inductor: bool, wide_grid: bool = False,
            deadline: float = math.inf, ceiling: bool = False, configs: tuple[Config, ...] | None = None,
            read_grids: tuple[Config, ...] = ()) -> list[dict]:
    from graphcap.kernels.gemm import skinny as sg

    k = x.shape[1]
    moved = ws[0].numel() * 2 + x.numel() * 2 + m * n * 2  # bytes read (weights, x) + written (out)
    fns = contestants(x, gated, n, inductor, wide_grid, ceiling, configs, read_grids)
    ref = fns["cublas"](ws[0])
    rows = []
    for i, (cname, fn) in enumerate(fns.items()):
        if which is not None and cname not in which:
            continue
        if i >= 2 and time.time() > deadline:  # cuBLAS and the plan always; the rest while the shape's budget lasts
            print(f"  {name} M={m}: {len(fns) - i} configs left untimed (past the shape's budget)", flush=True)
            rows.append(dict(shape=name, n=n, k=k, m=m, contestant="untimed", failed=f"{len(fns) - i} configs "
                             "left untimed (past the shape's budget)"))
            break
        row = dict(shape=name, n=n, k=k, m=m, contestant=cname, mbytes=round(moved / 1e6, 2))
        if cname == "plan" or cname in CEILINGS:
            row["config"] = sg.plan(m, n, k, gated).name
        elif is_read(cname):
            row["config"] = cname.removeprefix("read@")
        try:
            row["err"] = None if is_read(cname) else rel_err(fn(ws[0]), ref)
            if row["err"] is not None and row["err"] > MAX_ERR:
                row["failed"] = f"error {row['err']:.2e} vs cublas"
            else:
                us = graph_us(fn, ws, rep_ms)
                gbs = moved / (us * 1e-6) / 1e9
                row.update(us=round(us, 2), gbps=round(gbs, 1), pct_copy=round(100 * gbs / copy_gbs, 1))
        except Exception as e:  # noqa: BLE001 - a config that does not compile or capture is a result
            row["failed"] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        err = row.get("err")
        print(f"  {name} M={m} {cname:>24}: err {float('nan') if err is None else err:.1e}  "
              f"{row.get('us', '-')} us  {row.get('pct_copy', '-')} % copy  {row.get('failed', '')}", flush=True)
        rows.append(row)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for key in dict.fromkeys((r["shape"], r["m"]) for r in rows):
        rs = {r["contestant"]: r for r in rows if (r["shape"], r["m"]) == key and "us" in r}
        ours = {c: r for c, r in rs.items() if c not in ("cublas", "inductor") and not is_read(c)}
        reads = {c: r for c, r in rs.items() if is_read(c) and c != "read-tma"}
        base = min((rs[c]["us"] for c in ("cublas", "inductor") if c in rs), default=None)
        best = min(ours, key=lambda c: ours[c]["us"], default=None)
        named = ("cublas", "inductor", "plan", *CEILINGS)
        s = dict(shape=key[0], m=key[1], **{f"{c.replace('-', '_')}_us": rs[c]["us"] for c in named if c in rs},
                 **{f"{c.replace('-', '_')}_pct": rs[c]["pct_copy"] for c in named if c in rs})
        if len(reads) > 1:  # --read-grids: the fastest read over any grid timed
            fastest = min(reads, key=lambda c: reads[c]["us"])
            s.update(read_best=reads[fastest]["config"], read_best_us=reads[fastest]["us"],
                     read_best_pct=reads[fastest]["pct_copy"])
        if best is not None:
            s.update(best=best if best != "plan" else rs["plan"]["config"] + " (plan)", best_us=ours[best]["us"],
                     best_pct=ours[best]["pct_copy"])
            if base:
                s["speedup_best"] = round(base / ours[best]["us"], 2)
                if "plan" in rs:
                    s["speedup_plan"] = round(base / rs["plan"]["us"], 2)
        out.append(s)
    return out


def write(out: Path | None, env: dict, rows: list[dict], notes: list[str]) -> None:
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(rows)
    (out / "skinny_gemm.json").write_text(json.dumps(dict(env=env, summary=summary, rows=rows, notes=notes), indent=1))
    head = ["shape", "M", "cuBLAS us", "% copy", "Inductor us", "% copy", "plan us", "% copy", "best of ours",
            "us", "% copy", "best / baseline", "plan / baseline", "read us", "read-tma us", "fastest read",
            "us", "% copy"]
    keys = ["shape", "m", "cublas_us", "cublas_pct", "inductor_us", "inductor_pct", "plan_us", "plan_pct", "best",
            "best_us", "best_pct", "speedup_best", "speedup_plan", "read_us", "read_tma_us", "read_best",
            "read_best_us", "read_best_pct"]
    body = [[s.get(k, "-") for k in keys] for s in summary]
    text = [f"# skinny GEMM vs cuBLAS / Inductor ({env['device']}, {env['date']})", "",
            f"{bench_env.summary_line(env)}; copy bandwidth {env['copy_gbps']} GB/s (read + write). Time per call: "
            "a CUDA graph of calls over weight copies totalling >= 256 MB (L2 50 MB), median replay / calls. "
            "'baseline': the faster of cuBLAS and Inductor; speedups > 1 favour ours. 'read': a kernel that only "
            "reads the weights over the plan's grid (--ceiling); 'fastest read': the fastest of it over the grids "
            "timed (--read-grids).", "",
            tabulate(body, headers=head, tablefmt="github", disable_numparse=True)]
    fails = [f"- {r['shape']} M={r['m']} {r['contestant']}: {r['failed']}" for r in rows if "failed" in r]
    text += (["", "Failed:"] + fails if fails else []) + (["", "Notes:"] + [f"- {n}" for n in notes] if notes else [])
    (out / "skinny_gemm.md").write_text("\n".join(text) + "\n")


def read_grids_for(sweep: bool, named: tuple[Config, ...], n: int, k: int, gated: bool) -> tuple[Config, ...]:
    """The --read-grids configs for one shape: the sweep, or the named configs that tile it whole (`read_sums`
    takes whole tiles only)."""
    if sweep:
        return read_grid_configs(n, k, gated)
    rows = 2 * n if gated else n
    return tuple(c for c in named if rows % c.block_n == 0 and k % c.block_k == 0)


def main() -> None:
    ap = OneLineParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="directory for skinny_gemm.{json,md}")
    ap.add_argument("--quick", action="store_true", help="M in 1, 8, 64 and shorter repeats")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {','.join(SHAPES)}")
    ap.add_argument("--ms", default=None, help="comma-separated M values (default 1,2,4,8,16,32,64)")
    ap.add_argument("--rep-ms", type=float, default=None, help="milliseconds of replays per measurement")
    ap.add_argument("--budget-s", type=float, default=450.0,
                    help="past this many seconds, Inductor (compiled last, shape by shape) is skipped")
    ap.add_argument("--no-inductor", action="store_true")
    ap.add_argument("--grid", action="store_true",
                    help="time grid_configs (a wider search) instead of the shape class's candidates; each shape "
                         "and M gets an equal share of --budget-s")
    ap.add_argument("--configs", default=None,
                    help="comma-separated config names to time instead of the shape class's candidates")
    ap.add_argument("--ceiling", action="store_true",
                    help="also time two kernels that only read the weights over the plan's grid (read, read-tma)")
    ap.add_argument("--read-grids", default=None,
                    help="also time the read kernel over these configs' grids (comma-separated names), or 'sweep' "
                         "(read_grid_configs per shape)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("skinny_gemm: needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    shapes = args.shapes.split(",")
    if bad := [s for s in shapes if s not in SHAPES]:
        ap.error(f"--shapes: unknown {','.join(bad)}")
    try:
        ms = [int(v) for v in args.ms.split(",")] if args.ms else [1, 8, 64] if args.quick else list(MS)
    except ValueError:
        ap.error(f"--ms: expected comma-separated integers, got {args.ms!r}")
    if not all(1 <= m <= 64 for m in ms):
        ap.error("--ms: values in 1..64")
    if args.configs is not None and args.grid:
        ap.error("--configs and --grid: one or the other")
    try:
        configs = tuple(parse_config(c) for c in args.configs.split(",")) if args.configs is not None else None
    except ValueError as e:
        ap.error(f"--configs: {e}")
    try:
        named_reads = (tuple(parse_config(c) for c in args.read_grids.split(","))
                       if args.read_grids not in (None, "sweep") else ())
    except ValueError as e:
        ap.error(f"--read-grids: {e}")
    rep_ms = args.rep_ms or (5.0 if args.quick else 20.0)
    t0 = time.time()
    torch._dynamo.config.recompile_limit = torch._dynamo.config.accumulated_recompile_limit = 4096
    from graphcap.bench.roofline import measure_copy_bandwidth

    env = bench_env.environment(copy_gbps=round(measure_copy_bandwidth(), 1), rep_ms=rep_ms)
    torch.cuda.empty_cache()
    print(json.dumps(env, indent=1), flush=True)
    rows: list[dict] = []
    notes: list[str] = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    from graphcap.kernels.gemm.skinny_kernels import prepare_fixup

    prepare_fixup("cuda")  # the one-kernel split K's counters (without them its configs run the sum kernel)
    for inductor in [False] + ([] if args.no_inductor else [True]):  # ours and cuBLAS everywhere first
        for name in shapes:
            n, k, gated = SHAPES[name]
            if inductor and time.time() - t0 > args.budget_s:
                notes.append(f"{name}: Inductor skipped (past --budget-s {args.budget_s:.0f} s)")
                continue
            w = (torch.randn((2 * n if gated else n), k, generator=gen, device="cuda") / math.sqrt(k)).bfloat16()
            ws = [w] + [w.clone() for _ in range(math.ceil(ROTATE_BYTES / (w.numel() * 2)) - 1)]
            reads = () if inductor else read_grids_for(args.read_grids == "sweep", named_reads, n, k, gated)
            if skipped := [c.name for c in named_reads if c not in reads and not inductor]:
                notes.append(f"{name}: --read-grids {','.join(skipped)} not timed (not whole tiles of "
                             f"{2 * n if gated else n} x {k})")
            for m in ms:
                x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
                share = args.budget_s / (len(shapes) * len(ms))
                rows += measure(name, m, ws, x, gated, n, rep_ms, env["copy_gbps"],
                                {"inductor"} if inductor else None, inductor, args.grid and not inductor,
                                time.time() + share if args.grid and not inductor else math.inf,
                                args.ceiling and not inductor, configs,
                                reads if m == ms[0] else ())  # the read kernel ignores M: once per shape
            del w, ws
            torch.cuda.empty_cache()
            env["elapsed_s"] = round(time.time() - t0)
            rows.sort(key=lambda r: (list(SHAPES).index(r["shape"]), r["m"]))
            write(args.out, env, rows, notes)  # after every shape: a run cut short keeps what it measured
    print(tabulate([[s.get(k, "-") for k in ("shape", "m", "cublas_us", "inductor_us", "plan_us", "best", "best_us",
                                              "speedup_best")] for s in summarize(rows)],
                   headers=["shape", "M", "cuBLAS", "Inductor", "plan", "best", "us", "x"], tablefmt="github"))


if __name__ == "__main__":
    main()
