"""Achieved bandwidth of graphcap's decode attention at Gemma 4 draft shapes, against the copy bandwidth measured in
the same run and against sglang's own Triton `decode_attention_fwd` on the same data.

bandwidth = bytes of K and V actually read (per row min(len, W) or len tokens x kv heads x head dim x 2 bytes, K and
V) / median time of a CUDA graph holding one call (how the draft runs it), the L2 emptied before each call by
writing (`--l2 dirty`, triton's do_bench), by reading (`--l2 clean`), or timed among 256 MB reads inside one graph
(`--l2 in-graph`). The registered op's eager time (host launch overhead included) is reported beside.
Pools are random bf16 with page-shuffled allocation (page 64), read through per-token location tables exactly as the
draft does (sliding: a [B, W] ring, full: req_to_token rows).

Per shape it measures: the op as registered (its plan, `plan_attention`), a small sweep of kernel configs
(BLOCK_N, num_warps, num_stages) and split choices (splits, min_chunk), keeping the best; sglang's kernel at
num_kv_splits 8 (its default) and the best of 8/16/32. Outputs are checked: ours vs sglang (relative error), and ours
vs a float64 recomputation of two rows.

The config search is lab/attention_tuning.py, the tables and files lab/attention_report.py.

    python lab/attention_bw.py --out DIR          # CUDA only; writes attention_bw.{md,csv,json} into DIR
    TRITON_INTERPRET=1 python lab/attention_bw.py --cpu-smoke   # the script's logic on CPU, tiny shapes
"""
from __future__ import annotations

import importlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
from attention_report import render, write  # lab/: the script's directory is on sys.path
from attention_tuning import GRID_TILES, TUNE, cfg_name, grid, sweep
from graph_timing import copy_bandwidth, flush_buffer, in_graph_ms

from graphcap.bench import environment as bench_env
from graphcap.bench import timing
from graphcap.bench.options import OneLineParser
from graphcap.kernels.attention.decode import decode_attention, decode_attention_with_config
from graphcap.kernels.attention.plan import default_config, plan_attention

PAGE = 64
DEVICE = "cuda"  # "cpu" only for --cpu-smoke (the script's logic under TRITON_INTERPRET=1; timings meaningless)
DTYPE = torch.bfloat16  # float32 under --cpu-smoke (the interpreter's bf16 tl.dot is broken, sglang's kernel uses it)
LAYERS = {
    "sliding": dict(heads=32, kv_heads=16, dim=256, window=1024),
    "full": dict(heads=32, kv_heads=4, dim=512, window=0),
}
SGLANG_PATHS = ("sglang.kernels.ops.attention.decode_attention",  # 0.5.23
                "sglang.srt.layers.attention.triton_ops.decode_attention")  # older releases


def import_sglang():
    errors = []
    for path in SGLANG_PATHS:
        try:
            mod = importlib.import_module(path)
            import sglang

            return mod.decode_attention_fwd, f"{path} (sglang {getattr(sglang, '__version__', '?')})"
        except Exception as e:  # noqa: BLE001 - any import problem means: no sglang column
            errors.append(f"{path}: {type(e).__name__}: {e}")
    return None, "not importable: " + " | ".join(errors)


def environment(sglang_note: str) -> dict:
    """The benchmarks' one environment report, plus which sglang kernel this run compares against."""
    env = bench_env.environment()
    env["sglang_kernel"] = sglang_note
    return env


L2_MODE = "dirty"  # --l2: how the L2 is emptied before each timed call (see bench_clean)


def bench(fn, rep_ms: float) -> float:
    """Median milliseconds. `--l2 dirty` (default): triton.testing.do_bench, which empties the L2 before each call
    by writing 256 MB - the timed call then also pays for writing those dirty lines back to memory as its reads
    evict them. `--l2 clean`: `bench_clean`."""
    if L2_MODE == "clean":
        return bench_clean(fn, rep_ms)
    return timing.do_bench_ms(fn, rep_ms)


def bench_clean(fn, rep_ms: float) -> float:
    """Median milliseconds with the L2 emptied by *reading* 256 MB before each call (clean lines: evicting them
    costs no write-back), CUDA events around the call alone - as in a draft iteration, where the kernels before
    attention read weights and leave little dirty data behind."""
    return timing.events_ms(fn, rep_ms, before=flush_buffer().sum)


def graph_ms(fn, rep_ms: float) -> float:
    """Median GPU milliseconds of `fn` replayed as a CUDA graph (how the draft runs it): no host launch overhead.
    `fn` is run once first (compiles, warms up), then captured; the graph is released afterwards.
    `--l2 in-graph`: graph_timing.in_graph_ms, among 256 MB reads inside one graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    if L2_MODE == "in-graph":
        return in_graph_ms(fn, rep_ms)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    try:
        return bench(g.replay, rep_ms)
    finally:
        del g


class Pools:
    """One random bf16 K/V pool pair per layer type, large enough for every shape; pages handed out shuffled."""

    def __init__(self, tokens: int, kv_heads: int, dim: int, seed: int, device: str = DEVICE) -> None:
        self.pages = -(-tokens // PAGE) + 1
        self.device = device
        g = torch.Generator(device=device).manual_seed(seed)
        n = self.pages * PAGE
        self.k = torch.randn(n, kv_heads, dim, generator=g, device=device, dtype=DTYPE)
        self.v = torch.randn(n, kv_heads, dim, generator=g, device=device, dtype=DTYPE)
        self.g = g

    def rows(self, batch: int, ctx: int, window: int) -> torch.Tensor:
        """[batch, cols] int32 locations. Full: position p of each row at column p. Sliding (window W): the ring,
        column p % W holding position p for the last min(ctx, W) positions (other columns 0)."""
        lo = max(0, ctx - window) if window else 0
        first_page, last_page = lo // PAGE, -(-ctx // PAGE)
        per_row = last_page - first_page
        if batch * per_row > self.pages - 1:
            raise MemoryError("pool too small")
        perm = 1 + torch.randperm(self.pages - 1, generator=self.g, device=self.device)[: batch * per_row]
        pos = torch.arange(lo, ctx, device=self.device)
        page_of = perm.view(batch, per_row)[:, pos // PAGE - first_page]
        locs = (page_of * PAGE + pos % PAGE).to(torch.int32)  # [batch, ctx - lo]
        if not window:
            return locs.contiguous()
        ring = torch.zeros(batch, window, dtype=torch.int32, device=self.device)
        ring[:, pos % window] = locs
        return ring


def sglang_runner(fwd, q, pools, table, lens_row, splits):
    """sglang's decode_attention_fwd on the same rows: CSR kv_indptr / kv_indices built from `table`."""
    b, h, d = q.shape
    n = table.shape[1] if lens_row is None else lens_row
    # int64 locations, as sglang's triton backend builds them (its kernel multiplies them by the pool's row stride
    # without widening: int32 locations overflow once location x Hkv x D passes 2^31)
    kv_indices = table[:, :n].reshape(-1).to(torch.int64).contiguous()
    kv_indptr = torch.arange(b + 1, device=DEVICE, dtype=torch.int32) * n
    o = torch.empty_like(q)
    logits = torch.empty(b, h, splits, d, dtype=torch.float32, device=DEVICE)
    lse = torch.empty(b, h, splits, dtype=torch.float32, device=DEVICE)
    num = torch.full((b,), splits, dtype=torch.int32, device=DEVICE)
    sm = 1.0 / math.sqrt(d)

    def run():
        fwd(q, pools.k, pools.v, o, kv_indptr, kv_indices, logits, lse, num, splits, sm, 1.0, 1.0)
        return o

    return run


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def check_rows(out, q, pools, table, n, sm) -> float:
    """float64 recomputation of rows 0 and B-1."""
    errs = []
    h, hkv = q.shape[1], pools.k.shape[1]
    for i in sorted({0, q.shape[0] - 1}):
        locs = table[i, :n].long()
        k, v = pools.k[locs].double(), pools.v[locs].double()
        qq = q[i].double().view(hkv, h // hkv, -1)
        s = torch.einsum("hgd,nhd->hgn", qq, k) * sm
        ref = torch.einsum("hgn,nhd->hgd", torch.softmax(s, -1), v).reshape(h, -1)
        errs.append(rel(out[i], ref))
    return max(errs)


def cpu_smoke() -> None:
    """Tiny shapes on CPU through Triton's interpreter, wall-clock timing: checks the script, not the GPU."""
    global DEVICE, DTYPE, bench, graph_ms, copy_bandwidth, environment
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--cpu-smoke needs TRITON_INTERPRET=1 in the environment (set before triton is imported)")
    DEVICE, DTYPE = "cpu", torch.float32
    LAYERS.update(sliding=dict(heads=4, kv_heads=2, dim=16, window=32), full=dict(heads=4, kv_heads=1, dim=16, window=0))
    TUNE.update(sliding=[(16, 1, 1), (32, 1, 1), (128, 1, 1)], full=[(16, 1, 1), (32, 1, 1)])

    def wall(fn, rep_ms):
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    bench = graph_ms = wall
    copy_bandwidth = lambda: 1.0  # noqa: E731
    environment = lambda note: dict(bench_env.environment(), sglang_kernel=note, device="cpu (smoke)")  # noqa: E731


def main() -> None:
    ap = OneLineParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="directory for attention_bw.{md,csv,json}")
    ap.add_argument("--layers", default="sliding,full")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--contexts", default="256,1024,2048,4096,8192,32768")
    ap.add_argument("--rep-ms", type=float, default=10.0, help="milliseconds of repeats per measurement")
    ap.add_argument("--budget-s", type=float, default=200.0,
                    help="past this many seconds, remaining shapes skip the config sweep (default + sglang only)")
    ap.add_argument("--no-tune", action="store_true", help="measure the default configuration only")
    ap.add_argument("--l2", choices=("dirty", "clean", "in-graph"), default="dirty",
                    help="empty the L2 before each timed call by writing (do_bench, default) or by reading 256 MB; "
                         "in-graph: 8 calls each after a 256 MB read inside one graph, the reads' time subtracted")
    ap.add_argument("--grid-splits", action="store_true",
                    help="like --grid with the default tile config only: every split count (checks the split rule)")
    ap.add_argument("--grid", action="store_true",
                    help="instead of the small sweep: every tile config x split count (GRID_TILES x GRID_SPLITS)")
    ap.add_argument("--no-sglang", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run the script's logic on CPU at tiny shapes (TRITON_INTERPRET=1); timings are meaningless")
    args = ap.parse_args()
    if args.cpu_smoke:
        cpu_smoke()
        args.batches, args.contexts = "1,3", "16,40"
    elif not torch.cuda.is_available():
        sys.exit("attention_bw: needs a CUDA GPU")
    global L2_MODE
    L2_MODE = args.l2
    t0 = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False

    fwd, sg_note = (None, "skipped (--no-sglang)") if args.no_sglang else import_sglang()
    env = environment(sg_note)
    env["l2"] = args.l2
    print(json.dumps(env, indent=1), flush=True)
    copy_gbs = copy_bandwidth()
    env["copy_gbps"] = round(copy_gbs, 1)
    print(f"copy bandwidth (read + write, 2 GiB): {copy_gbs:.0f} GB/s  [{time.time() - t0:.0f}s]", flush=True)

    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    rows_out, notes = [], []
    failed: set = set()  # configurations that did not compile (e.g. out of shared memory): tried once
    reuse: dict = {}
    for layer in args.layers.split(","):
        shp = LAYERS[layer]
        h, hkv, d, w = shp["heads"], shp["kv_heads"], shp["dim"], shp["window"]
        per_tok = hkv * d * DTYPE.itemsize * 2  # K and V
        need = max(b * (min(c, w) if w else c) for b in batches for c in contexts)
        tokens = max(need, 1 << 19) + 2 * PAGE * max(batches)  # sliding: a pool larger than the windows, like sglang's
        free = torch.cuda.mem_get_info()[0] if DEVICE == "cuda" else 1 << 30
        while tokens * per_tok > 0.6 * free:
            tokens //= 2
            notes.append(f"{layer}: pool reduced to {tokens} tokens to fit memory")
        pools = Pools(tokens, hkv, d, seed=1 if layer == "sliding" else 2, device=DEVICE)
        sm = 1.0 / math.sqrt(d)
        for b in batches:
            for ctx in contexts:
                n = min(ctx, w) if w else ctx
                try:
                    table = pools.rows(b, ctx, w)
                except MemoryError:
                    notes.append(f"{layer} B={b} ctx={ctx}: skipped (pool of {tokens} tokens too small)")
                    continue
                g = torch.Generator(device=DEVICE).manual_seed(b * 100003 + ctx)
                q = torch.randn(b, h, d, generator=g, device=DEVICE, dtype=DTYPE)
                slots = torch.randperm(b, device=DEVICE)
                lens = torch.zeros(b, dtype=torch.int32, device=DEVICE)
                lens[slots] = ctx
                tab = torch.empty_like(table)
                tab[slots] = table  # row b of the batch reads table row slots[b]
                nbytes = b * n * per_tok
                gbs = lambda ms: nbytes / (ms * 1e-3) / 1e9  # noqa: E731
                plan = plan_attention(b, hkv, d, DTYPE, DEVICE, n)  # what the draft layers use for rows of n tokens
                s0 = plan.num_splits
                row = dict(layer=layer, batch=b, ctx=ctx, tokens_read=n, mbytes=round(nbytes / 1e6, 2), splits=s0)

                out = decode_attention(q, pools.k, pools.v, tab, slots, lens, w, sm, plan=plan)
                table_b = table  # = tab[slots]: batch row i's locations
                row["err_ref"] = check_rows(out, q, pools, table_b, n, sm)
                op = lambda: decode_attention(q, pools.k, pools.v, tab, slots, lens, w, sm, plan=plan)  # noqa: E731
                ms = graph_ms(op, args.rep_ms)
                eager_ms = bench(op, args.rep_ms)
                row.update(default_us=round(ms * 1e3, 1), default_gbps=round(gbs(ms)),
                           eager_us=round(eager_ms * 1e3, 1))

                best = (ms, "default", s0)
                tune = not args.no_tune and time.time() - t0 < args.budget_s
                if tune:
                    run_cfg = lambda cfg, s: graph_ms(  # noqa: E731
                        lambda: decode_attention_with_config(q, pools.k, pools.v, tab, slots, lens, w, sm, s, cfg),
                        args.rep_ms)
                    if args.grid or args.grid_splits:
                        dc = default_config(d, DTYPE, True)
                        tiles = [(dc.block_n, dc.num_warps, dc.num_stages)] if args.grid_splits else GRID_TILES
                        timed = grid(layer, run_cfg, n, failed, notes, tiles)
                    elif w and ctx > w and (layer, b) in reuse:
                        # a sliding layer reads the same W tokens per row at every context past W: re-time the best
                        # configuration found at ctx = W instead of sweeping again
                        timed = [(run_cfg(*reuse[layer, b]), *reuse[layer, b])]
                    else:
                        timed = sweep(layer, run_cfg, s0, default_config(d, DTYPE, True), failed, notes)
                    if timed:
                        t_best, cfg_best, s_best = min(timed, key=lambda x: x[0])
                        if w and ctx == w:
                            reuse[layer, b] = (cfg_best, s_best)
                        row["sweep"] = [[round(t * 1e3, 1), cfg_name(c), sp]
                                        for t, c, sp in sorted(timed, key=lambda x: x[0])]
                        if args.grid or args.grid_splits:
                            print("  top 12:", row["sweep"][:12], flush=True)
                        if t_best < best[0]:
                            best = (t_best, cfg_name(cfg_best), s_best)
                            o_best = decode_attention_with_config(q, pools.k, pools.v, tab, slots, lens, w, sm, s_best,
                                                                  cfg_best)
                            row["err_best_vs_default"] = rel(o_best, out)
                row.update(best_us=round(best[0] * 1e3, 1), best_gbps=round(gbs(best[0])), best_config=best[1],
                           best_splits=best[2], best_pct_copy=round(100 * gbs(best[0]) / copy_gbs, 1),
                           default_pct_copy=round(100 * gbs(ms) / copy_gbs, 1), tuned=tune)

                if fwd is not None:
                    sg = {}
                    for s in (8, 16, 32):
                        try:
                            run = sglang_runner(fwd, q, pools, table_b, n, s)
                            o_sg = run().clone()
                            sg[s] = graph_ms(run, args.rep_ms)
                        except Exception as e:  # noqa: BLE001
                            notes.append(f"sglang {layer} B={b} ctx={ctx} splits={s}: {type(e).__name__}: {str(e)[:200]}")
                            continue
                        if s == 8:
                            row["err_vs_sglang"] = rel(out, o_sg)
                    if sg:
                        s_best = min(sg, key=sg.get)
                        row.update(sglang8_us=round(sg.get(8, float("nan")) * 1e3, 1),
                                   sglang_best_us=round(sg[s_best] * 1e3, 1), sglang_best_splits=s_best,
                                   sglang_best_gbps=round(gbs(sg[s_best])),
                                   speedup_default_vs_sglang=round(sg[s_best] / ms, 2),
                                   speedup_best_vs_sglang=round(sg[s_best] / best[0], 2))
                rows_out.append(row)
                print(json.dumps(row), f"[{time.time() - t0:.0f}s]", flush=True)
                env["elapsed_s"] = round(time.time() - t0, 1)
                write(args.out, env, rows_out, notes)  # after every shape: a run cut short keeps what it measured
                del table, tab, table_b, q, out
        del pools
        if DEVICE == "cuda":
            torch.cuda.empty_cache()

    env["elapsed_s"] = round(time.time() - t0, 1)
    write(args.out, env, rows_out, notes)
    print(render(env, rows_out, notes))


if __name__ == "__main__":
    main()
