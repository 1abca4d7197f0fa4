"""sgl_kernel's `int8_scaled_mm` as graphcap's stand-in runs it (tests/support/sgl_kernel/int8_gemm.py) at the
projection shapes of a Gemma-4-31B target in W8A8 (int8 weights with per-output-channel scales, int8 activations
with per-token scales), decode rows M = 1..64, against
- the int8 weight-read floor: N * K bytes at the device-to-device copy bandwidth measured in the same run (bytes read
  plus written: graphcap.bench.roofline), the least any kernel that reads the weights once can take;
- torch's own int8 GEMM, a baseline a user could pick: `torch._int_mm` (cuBLASLt, int32 out), then the two scales in
  fp32 and the cast in eager torch (`torch-int8`), and the `_int_mm` call alone (`int_mm-only`). cuBLASLt takes only
  M > 16 rows: smaller M runs on rows padded to 17 (the padding made outside the timed call).

Shapes (sglang fuses q/k/v and gate/up; full layers load K into V as well, so their qkv holds both):
  qkv_sliding N = 32 x 256 + 2 x 16 x 256 = 16384, K = 5376    o_sliding N = 5376, K = 8192
  qkv_full    N = 32 x 512 + 2 x 4 x 512  = 20480, K = 5376    o_full    N = 5376, K = 16384
  gate_up     N = 2 x 21504 = 43008,               K = 5376    down      N = 5376, K = 21504
Each call's output is checked against the stand-in's torch twin first (bit for bit, as the tests require), torch's
against the twin too (max |a - b| / max |b|). Times: each contestant is captured in a CUDA graph (as sglang's decode
runs it: no host time between its kernels) and the graph's replay timed by triton.testing.do_bench (L2 emptied
before each replay; median), per call. The 60-layer line sums one token's projections: 50 sliding and 10 full
layers, gate_up and down in each. --candidates also times every candidate config of the stand-in's plan.

    python bench/int8_gemm.py --out FILE.json [--ms 1,2,4,8,16,32,48,64] [--shapes qkv_sliding,down]
                              [--rep-ms 50] [--candidates]        # CUDA only
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphcap.bench.options import OneLineParser, ints

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MS = (1, 2, 4, 8, 16, 32, 48, 64)
INT_MM_MIN_ROWS = 17  # cuBLASLt's int8 GEMM through torch._int_mm needs M > 16


@dataclass(frozen=True)
class Model:
    """The target's projection dimensions (Gemma-4-31B)."""

    hidden: int = 5376
    ffn: int = 21504
    q_heads: int = 32
    sliding_kv_heads: int = 16
    sliding_head_dim: int = 256
    full_kv_heads: int = 4
    full_head_dim: int = 512
    sliding_layers: int = 50
    full_layers: int = 10


GEMMA4_31B = Model()


def projection_shapes(model: Model = GEMMA4_31B) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of each projection's int8_scaled_mm (mat_b is [K, N])."""
    h = model.hidden
    qkv = {kind: (model.q_heads * d + 2 * kv * d, h) for kind, kv, d in
           (("sliding", model.sliding_kv_heads, model.sliding_head_dim),
            ("full", model.full_kv_heads, model.full_head_dim))}
    return {"qkv_sliding": qkv["sliding"], "o_sliding": (h, model.q_heads * model.sliding_head_dim),
            "qkv_full": qkv["full"], "o_full": (h, model.q_heads * model.full_head_dim),
            "gate_up": (2 * model.ffn, h), "down": (h, model.ffn)}


def calls_per_token(model: Model = GEMMA4_31B) -> dict[str, int]:
    """How often one token's forward runs each projection."""
    layers = model.sliding_layers + model.full_layers
    return {"qkv_sliding": model.sliding_layers, "o_sliding": model.sliding_layers, "qkv_full": model.full_layers,
            "o_full": model.full_layers, "gate_up": layers, "down": layers}


def floor_us(n: int, k: int, copy_gbps: float) -> float:
    """Microseconds to read N * K int8 weight bytes at the copy bandwidth (GB/s, bytes read plus written)."""
    return n * k / (copy_gbps * 1e9) * 1e6


def parse_args(argv: list[str] | None = None) -> Any:
    shapes = projection_shapes()
    p = OneLineParser(prog="bench/int8_gemm.py", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the JSON record to write")
    p.add_argument("--ms", type=ints, default=DEFAULT_MS, help="decode rows M, comma-separated")
    p.add_argument("--shapes", default=",".join(shapes), help=f"projections, comma-separated: {', '.join(shapes)}")
    p.add_argument("--rep-ms", type=float, default=50.0, help="do_bench's time per measurement (ms)")
    p.add_argument("--candidates", action="store_true", help="also time every candidate config of the plan")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    names = tuple(s.strip() for s in a.shapes.split(",") if s.strip())
    unknown = [s for s in names if s not in shapes]
    if unknown or not names:
        p.error(f"--shapes: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(shapes)}")
    a.shapes = names
    if a.rep_ms <= 0:
        p.error(f"--rep-ms must be > 0, got {a.rep_ms}")
    return a


# ---------------------------------------------------------------------------------------------------------------
# the report (pure: the tests run it without CUDA)


def record(shape: str, m: int, n: int, k: int, copy_gbps: float, standin_us: float, config: str,
           torch_us: float | None, int_mm_us: float | None, exact: bool, torch_rel_err: float | None) -> dict:
    f = floor_us(n, k, copy_gbps)
    return {"shape": shape, "m": m, "n": n, "k": k, "config": config, "floor_us": f, "standin_us": standin_us,
            "x_floor": standin_us / f, "weight_gbps": n * k / (standin_us * 1e-6) / 1e9,
            "pct_copy": 100 * f / standin_us, "torch_us": torch_us, "int_mm_us": int_mm_us,
            "torch_over_standin": torch_us / standin_us if torch_us else None, "exact_vs_twin": exact,
            "torch_rel_err": torch_rel_err}


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def table(rows: list[dict]) -> str:
    from tabulate import tabulate

    head = ["shape", "M", "N", "K", "plan", "floor us", "stand-in us", "x floor", "% copy", "torch-int8 us",
            "int_mm-only us", "torch / stand-in", "bits = twin"]
    body = [[r["shape"], r["m"], r["n"], r["k"], r["config"], _f(r["floor_us"], ".1f"), _f(r["standin_us"], ".1f"),
             _f(r["x_floor"], ".2f"), _f(r["pct_copy"], ".0f"), _f(r["torch_us"], ".1f"), _f(r["int_mm_us"], ".1f"),
             _f(r["torch_over_standin"], ".2f"), "yes" if r["exact_vs_twin"] else "NO"] for r in rows]
    return tabulate(body, head, tablefmt="github")


def per_token(rows: list[dict], counts: dict[str, int] | None = None) -> list[dict]:
    """One token's projections per M (every shape measured at that M): floor and stand-in sums, in ms."""
    counts = counts or calls_per_token()
    out = []
    for m in sorted({r["m"] for r in rows}):
        at = {r["shape"]: r for r in rows if r["m"] == m}
        if set(at) != set(counts):
            continue
        out.append({"m": m, "floor_ms": sum(counts[s] * at[s]["floor_us"] for s in counts) / 1e3,
                    "standin_ms": sum(counts[s] * at[s]["standin_us"] for s in counts) / 1e3,
                    "torch_ms": (sum(counts[s] * at[s]["torch_us"] for s in counts) / 1e3
                                 if all(at[s]["torch_us"] for s in counts) else None)})
    return out


def report(rows: list[dict], copy_gbps: float, env: dict, candidates: dict | None = None) -> dict:
    return {"what": "bench/int8_gemm.py: sgl_kernel.int8_scaled_mm as the stand-in runs it, Gemma-4-31B W8A8 "
                    "projections, us per call (CUDA-graph replay, median of do_bench, L2 emptied), against the int8 "
                    "weight-read floor and torch._int_mm + eager scaling",
            "environment": env, "copy_gbps": copy_gbps, "rows": rows, "per_token_60_layers": per_token(rows),
            "candidates": candidates or {}}


# ---------------------------------------------------------------------------------------------------------------
# the measurements (CUDA)


def _standin() -> Any:
    """The stand-in's module, through the package as sglang's engine imports it."""
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from sgl_kernel import int8_gemm

    return int8_gemm


def _inputs(m: int, n: int, k: int, seed: int) -> dict:
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randint(-127, 128, (m, k), device="cuda", generator=g, dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), device="cuda", generator=g, dtype=torch.int8)
    return dict(mat_a=a, mat_b=w.t(), scales_a=torch.rand(m, 1, device="cuda", generator=g) * 1e-2 + 1e-3,
                scales_b=torch.rand(n, 1, device="cuda", generator=g) * 1e-2 + 1e-3, out_dtype=torch.bfloat16,
                bias=None)


def _torch_int8(args: dict) -> tuple[Callable[[], Any], Callable[[], Any]] | None:
    """(_int_mm + scaling + cast, _int_mm alone) over rows padded to INT_MM_MIN_ROWS; None where torch has no int8
    GEMM on this device."""
    import torch

    a, b, m = args["mat_a"], args["mat_b"], args["mat_a"].shape[0]
    if m < INT_MM_MIN_ROWS:
        a = torch.cat([a, a.new_zeros(INT_MM_MIN_ROWS - m, a.shape[1])])
    xs = torch.cat([args["scales_a"], args["scales_a"].new_ones(a.shape[0] - m, 1)])
    ws = args["scales_b"].reshape(1, -1)
    try:
        torch._int_mm(a, b)
    except (AttributeError, RuntimeError):
        return None

    def full():
        return (torch._int_mm(a, b).float() * ws * xs).to(args["out_dtype"])[:m]

    return full, lambda: torch._int_mm(a, b)


def graphed(fn: Callable[[], Any]) -> Callable[[], None]:
    """fn captured in a CUDA graph (warmed up on a side stream first, as torch's docs ask); returns its replay."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay  # the bound method keeps the graph alive


def measure(a: Any) -> tuple[list[dict], dict, float]:
    import torch

    from graphcap.bench.roofline import measure_copy_bandwidth
    from graphcap.bench.timing import do_bench_ms

    ig = _standin()
    shapes = projection_shapes()
    copy_gbps = measure_copy_bandwidth()
    print(f"copy bandwidth {copy_gbps:.0f} GB/s", flush=True)
    rows, cands = [], {}
    for name in a.shapes:
        n, k = shapes[name]
        for m in a.ms:
            args = _inputs(m, n, k, a.seed + m)
            want = ig.int8_scaled_mm_torch(**args)
            got = ig.int8_scaled_mm(**args)
            exact = bool(torch.equal(got.view(torch.int16), want.view(torch.int16)))
            us = 1e3 * do_bench_ms(graphed(lambda: ig.int8_scaled_mm(**args)), a.rep_ms)
            base = _torch_int8(args)
            torch_us = int_mm_us = rel = None
            if base is not None:
                t = base[0]()
                rel = float((t.float() - want.float()).abs().max() / want.float().abs().max())
                torch_us = 1e3 * do_bench_ms(graphed(base[0]), a.rep_ms)
                int_mm_us = 1e3 * do_bench_ms(graphed(base[1]), a.rep_ms)
            cfg = ig.plan(m, n, k)
            rows.append(record(name, m, n, k, copy_gbps, us, cfg.name, torch_us, int_mm_us, exact, rel))
            r = rows[-1]
            print(f"{name:12s} M={m:<3d} {cfg.name:18s} {us:7.1f} us  {r['x_floor']:.2f}x floor  "
                  f"torch {_f(torch_us, '.1f')} us  exact {exact}", flush=True)
            if a.candidates:
                times = {}
                out = torch.empty_like(got)
                order = ig.epilogue_order(got.device)
                for c in ig.candidates(m, n, k):
                    ig.launch(args["mat_a"], args["mat_b"], args["scales_a"], args["scales_b"], out, None, c, order)
                    ok = bool(torch.equal(out.view(torch.int16), want.view(torch.int16)))

                    def call(c=c):
                        return ig.launch(args["mat_a"], args["mat_b"], args["scales_a"], args["scales_b"], out, None,
                                         c, order)

                    times[c.name] = {"us": 1e3 * do_bench_ms(graphed(call), min(a.rep_ms, 20.0)),
                                     "exact_vs_twin": ok}
                best = min(times, key=lambda c: times[c]["us"])
                cands[f"{name}/m{m}"] = {"times": times, "best": best, "plan": cfg.name}
                print(f"{'':12s} best {best} {times[best]['us']:.1f} us", flush=True)
    return rows, cands, copy_gbps


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench/int8_gemm.py: needs a CUDA GPU (the stand-in's kernel is timed there)", file=sys.stderr)
        return 2
    from graphcap.bench import environment as bench_env

    rows, cands, copy_gbps = measure(a)
    result = report(rows, copy_gbps, bench_env.environment(), cands)
    print(table(rows))
    for t in result["per_token_60_layers"]:
        print(f"60 layers at M={t['m']}: floor {t['floor_ms']:.2f} ms, stand-in {t['standin_ms']:.2f} ms"
              + (f", torch-int8 {t['torch_ms']:.2f} ms" if t["torch_ms"] else ""))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
