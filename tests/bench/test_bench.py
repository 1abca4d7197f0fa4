"""`graphcap bench` on a CPU: every mode drafts what an independent float64 reference drafts, the sync counter
counts what it should, a run's rows carry every field (and None only with the reason), bad options are one line."""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import random

import pytest
import torch
from test_models import reference_iteration
from tiers import thorough

from graphcap.bench import options
from graphcap.bench.baselines import CompiledBaseline, RebuildBaseline, SglangBaseline, graph_problem
from graphcap.bench.counting import count_kernels, count_syncs
from graphcap.bench.report import CPU_SCOPE
from graphcap.bench.rows import BenchRow
from graphcap.bench.runner import build_modes
from graphcap.bench.state import make_target_state
from graphcap.engine.capture import DraftGraphs
from graphcap.engine.options import CaptureOptions
from graphcap.cli import build_parser, main
from graphcap.kernels import twins_on_cpu
from graphcap.models import DraftLoop, FrozenKVDraft
from graphcap.models.fused_op_set import fused_ops
from graphcap.spec import load_spec
from graphcap.window import WindowBuffers

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is scripts/gpu-check.sh bench")


def _config(*argv: str) -> options.BenchConfig:
    return options.config_from_args(build_parser().parse_args(["bench", *argv]), torch.cuda.is_available())


@cpu_only
@pytest.mark.compile
@pytest.mark.parametrize("names", [("eager-rebuild", "compile", "graphcap"),
                                   thorough(("compile-nosync", "compile-plain"), id="compile-nosync,compile-plain")],
                         ids=",".join)
def test_every_mode_drafts_the_reference_tokens(names):
    """eager-rebuild, compile (Inductor, graphcap's twins) and graphcap, one iteration each from the same state and
    inputs, against test_models' float64 reference (K/V gathered straight from req_to_token, no ring, no kernels);
    the other compiled loops (each an Inductor compile more) in the thorough tier."""
    spec = load_spec("tiny")  # W = 16: rows below, at and past the window
    lens0 = [1, 5, 16, 40, 70, 3]
    cfg = _config("--spec", "tiny", "--batch", str(len(lens0)), "--context", "8", "--iters", "1",
                  "--modes", ",".join(names), "--graphcap-backend", "eager")
    st = make_target_state(spec, lens0, [n + 8 for n in lens0], seed=3)
    model = FrozenKVDraft(spec, seed=4)
    notes: list[str] = []
    modes = build_modes(cfg, model, st, spec.capture.steps, notes)
    assert tuple(m.name for m in modes) == names
    g = torch.Generator().manual_seed(5)
    accepted = torch.randint(1, spec.capture.steps + 2, (len(lens0),), generator=g, dtype=torch.int32)
    tokens = torch.randint(0, spec.draft.vocab, (len(lens0),), generator=g)
    hidden = torch.randn(len(lens0), spec.target.hidden, generator=g)
    lens = [n + a for n, a in zip(lens0, accepted.tolist())]
    ref_loop = DraftLoop(model, modes[0].window, st.k_swa, st.v_swa, st.k_full, st.v_full)
    ref_tok, _, ref_margin, _ = reference_iteration(ref_loop, st, lens, tokens, hidden)
    decided = ref_margin > 1e-3  # near-ties may flip under fp32 rounding
    assert decided.float().mean() > 0.8
    for m in modes:
        # Inductor cannot lower interpreted Triton kernels (TRITON_INTERPRET=1 in the tests): twins, as in a CPU run
        with twins_on_cpu() if m.name.startswith("compile") else contextlib.nullcontext():
            m.window.reset(st.slots.tolist(), lens0)
            m.runner.capture()
            m.window.reset(st.slots.tolist(), lens0)
            out = m.runner.run(st.slots, accepted, tokens, hidden, host_slots=st.slots.tolist())
        assert m.window.seq_lens[st.slots].tolist() == lens, m.name
        assert torch.equal(out.tokens[decided], ref_tok[decided]), m.name
        assert graph_problem(m.runner) == "", m.name
    runners = {m.name: m.runner for m in modes}
    if "compile" in runners:
        # the compiled baseline's recompile check: a batch it was not captured for compiles again, and says so
        compiled = runners["compile"]
        assert compiled.syncs == 4  # 3 capture calls + 1: sglang's .item(), outside the compiled function
        with twins_on_cpu():
            compiled.run(st.slots[:2], accepted[:2], tokens[:2], hidden[:2])
        assert graph_problem(compiled) == "recompiled after capture (1 new Dynamo cache entries)"
    if "compile-nosync" in runners:
        assert runners["compile-nosync"].syncs == 0  # the same compiled loop without the .item()
        plain = runners["compile-plain"]
        assert plain.syncs == 0 and plain.loop.ops.name == "torch-plain"  # a hand-written loop


def test_compile_tuned_is_compile_plain_with_gpt_fasts_inductor_setting(monkeypatch):
    """compile-tuned: compile-plain's loop and ops under reduce-overhead given as its one Inductor option
    (triton.cudagraphs) plus gpt-fast's coordinate_descent_tuning - torch takes a mode or options, not both; every
    other compile keeps its mode and options as before."""
    import graphcap.engine.recording as recording

    calls = []
    monkeypatch.setattr(recording.torch, "compile", lambda fn, **kw: (calls.append(kw), fn)[1])
    spec = load_spec("tiny")
    cfg = _config("--spec", "tiny", "--batch", "2", "--context", "8", "--iters", "1",
                  "--modes", "compile-plain,compile-tuned", "--graphcap-backend", "eager")
    st = make_target_state(spec, [3, 9], [12, 20], seed=1)
    modes = build_modes(cfg, FrozenKVDraft(spec, seed=2), st, spec.capture.steps, [])
    assert [m.name for m in modes] == ["compile-plain", "compile-tuned"]
    assert modes[0].runner.loop.ops == modes[1].runner.loop.ops
    plain, tuned = calls
    assert (plain["mode"], plain["options"]) == ("reduce-overhead", None)
    assert (tuned["mode"], tuned["options"]) == (None, {"triton.cudagraphs": True, "coordinate_descent_tuning": True})
    assert {k: v for k, v in plain.items() if k not in ("mode", "options")} == \
        {k: v for k, v in tuned.items() if k not in ("mode", "options")}
    calls.clear()
    recording.compile_iteration(lambda *a: a, "inductor-cudagraph", (), 1, "t", inductor={"max_autotune": True})
    assert (calls[0]["mode"], calls[0]["options"]) == (None, {"triton.cudagraphs": False, "max_autotune": True})


@cpu_only
@pytest.mark.interpreter
@pytest.mark.parametrize("name", ["sglang", pytest.param("compile", marks=[pytest.mark.thorough, pytest.mark.compile])])
def test_sglang_and_compile_modes_with_sglangs_kernels_draft_the_reference_tokens(name):
    """The `sglang` and `compile` modes as they run on CUDA - sglang 0.5.23's index builder, split rule and decode
    kernel, the fused op set with sglang's post-MLP kernel - here with the Triton kernels in Triton's interpreter:
    the `sglang` mode's steps through graphcap's eager backend instead of a CUDA graph, `compile` under Inductor with
    sglang's kernels as opaque ops (the fused ops' twins inside, as Inductor cannot lower interpreted Triton). Tokens
    as the float64 reference's; the rebuild's one host sync per iteration."""
    for name in ("decode_attention", "kv_indices", "metadata"):
        pytest.importorskip(f"sglang.kernels.ops.attention.{name}")
    pytest.importorskip("sglang.kernels.ops.layernorm.gemma4_fused_ops")
    spec = load_spec("tiny")
    lens0 = [1, 5, 16, 40, 70, 3]
    st = make_target_state(spec, lens0, [n + 8 for n in lens0], seed=3)
    model = FrozenKVDraft(spec, seed=4)
    g = torch.Generator().manual_seed(5)
    accepted = torch.randint(1, spec.capture.steps + 2, (len(lens0),), generator=g, dtype=torch.int32)
    tokens = torch.randint(0, spec.draft.vocab, (len(lens0),), generator=g)
    hidden = torch.randn(len(lens0), spec.target.hidden, generator=g)
    lens = [n + a for n, a in zip(lens0, accepted.tolist())]
    ops = fused_ops()
    assert ops.post_norm is not None
    wb = WindowBuffers.from_spec(spec, st.req_to_token, st.full_to_swa)
    wb.reset(st.slots.tolist(), lens0)
    loop = DraftLoop(model, wb, st.k_swa, st.v_swa, st.k_full, st.v_full)
    if name == "sglang":
        runner = SglangBaseline(loop, ops, (8,), cores=132, backend="eager")
        ctx = contextlib.nullcontext()
    else:
        runner = CompiledBaseline(loop, ops, (len(lens0),), sglang_kernels=True, warm_slots=st.slots, cores=132)
        ctx = twins_on_cpu()
    with ctx:
        runner.capture()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = runner.run(st.slots, accepted, tokens, hidden, host_slots=st.slots.tolist())
    assert wb.seq_lens[st.slots].tolist() == lens
    called = {e.name for e in prof.events()}
    assert "graphcap::sglang_rmsnorm_residual_scalar" in called  # the one-kernel post-MLP norm
    if name == "compile":  # sglang's attention as opaque ops inside the compiled function
        assert {"graphcap_bench::sglang_decode", "graphcap_bench::sglang_build_indices"} <= called
    ref_tok, _, ref_margin, _ = reference_iteration(loop, st, lens, tokens, hidden)
    decided = ref_margin > 1e-3
    assert decided.float().mean() > 0.8
    assert torch.equal(out.tokens[decided], ref_tok[decided])
    if name == "sglang":
        assert runner.syncs == 1 and runner.seq_lens_sum == sum(lens)


def test_sync_counter_counts_planted_host_reads(device):
    x = torch.randn(8, device=device)
    cuda = device == "cuda"
    assert count_syncs(lambda: (x * 2).sum(), cuda).value == 0
    assert count_syncs(lambda: (x * 2).sum().item(), cuda).value == 1
    assert count_syncs(lambda: int(x.argmax()) + float(x.max()), cuda).value == 2


def test_only_torchs_per_sync_warning_counts_as_a_sync():
    """torch's first switch to sync debug mode also warns, once per process, that the mode 'does not yet detect all
    synchronizing operations': that notice is not a sync (read as one, it gave the first counted call of each bench
    run one sync it did not do)."""
    from graphcap.bench.counting import is_sync_warning

    assert is_sync_warning("called a synchronizing CUDA operation (Triggered internally at c10/cuda/CUDAFunctions.cpp)")
    assert not is_sync_warning("Synchronization debug mode is a prototype feature and does not yet detect all "
                               "synchronizing operations (Triggered internally at torch/csrc/cuda/Module.cpp)")


@pytest.mark.subprocess
@pytest.mark.gpu
def test_the_first_count_in_a_process_sees_no_sync_in_a_call_without_one():
    import subprocess
    import sys

    code = ("import torch; from graphcap.bench.counting import count_syncs; x = torch.randn(8, device='cuda'); "
            "print(count_syncs(lambda: (x * 2).sum(), True).value, count_syncs(lambda: x.sum().item(), True).value)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["0", "1"]


def test_sync_counter_sees_the_rebuild_sync_and_none_in_graphcap(device):
    spec = load_spec("tiny")
    st = make_target_state(spec, [20, 9], 64, seed=1, device=device)
    model = FrozenKVDraft(spec, seed=2, device=device)
    cuda = device == "cuda"
    args = (st.slots, torch.ones(2, dtype=torch.int32, device=device), torch.zeros(2, dtype=torch.int64,
            device=device), torch.zeros(2, spec.target.hidden, device=device))
    loops = []
    for _ in range(2):
        wb = WindowBuffers.from_spec(spec, st.req_to_token, st.full_to_swa)
        wb.reset(st.slots.tolist(), [20, 9])
        loops.append(DraftLoop(model, wb, st.k_swa, st.v_swa, st.k_full, st.v_full))
    rebuild = RebuildBaseline(loops[0], graphed=False)
    graphs = DraftGraphs.for_loop(loops[1], CaptureOptions(backend="cudagraph" if cuda else "eager", buckets=(2,),
                                                           manifest_path=None))
    graphs.capture()
    host_slots = st.slots.tolist()  # an engine has them on the host
    assert count_syncs(lambda: rebuild.run(*args), cuda).value == 1
    assert count_syncs(lambda: graphs.run(*args, host_slots=host_slots), cuda).value == 0
    k = count_kernels(lambda: graphs.run(*args, host_slots=host_slots), cuda)
    assert (k.value is None and "CPU" in k.how) if not cuda else k.value > 0  # exact: the next test, on a GPU


@pytest.mark.gpu
def test_kernel_counter_sees_every_kernel_of_a_graph_replay():
    """A replayed CUDA graph of one draft iteration launches exactly the kernels the same iteration launches eagerly
    (the bucket is the batch: no padding fill; the zero-copy replay, its inputs written before the count), and run()
    one kernel more: its input copy, one multi-tensor launch."""
    spec = load_spec("tiny")
    st = make_target_state(spec, [20, 9], 64, seed=1, device="cuda")
    model = FrozenKVDraft(spec, seed=2, device="cuda")
    args = (st.slots, torch.ones(2, dtype=torch.int32, device="cuda"), torch.zeros(2, dtype=torch.int64,
            device="cuda"), torch.zeros(2, spec.target.hidden, device="cuda"))
    wb = WindowBuffers.from_spec(spec, st.req_to_token, st.full_to_swa)
    wb.reset(st.slots.tolist(), [20, 9])
    loop = DraftLoop(model, wb, st.k_swa, st.v_swa, st.k_full, st.v_full)
    graphs = DraftGraphs.for_loop(loop, CaptureOptions(backend="cudagraph", buckets=(2,), manifest_path=None))
    graphs.capture()
    assert [b.status for b in graphs.buckets] == ["captured"]
    loop(*args)  # warm: nothing lazy left for the counted eager call
    eager = count_kernels(lambda: loop(*args), True)
    for static, x in zip(graphs.static_inputs(2), args):
        static.copy_(x)
    replay = count_kernels(lambda: graphs.replay(2), True)
    run = count_kernels(lambda: graphs.run(*args, host_slots=st.slots.tolist()), True)
    assert eager.value > 0 and replay.value == eager.value and run.value == eager.value + 1, (eager, replay, run)


@cpu_only
def test_cpu_run_rows_carry_every_field_and_say_why_a_value_is_missing(tmp_path, capsys):
    """A CPU run as `make bench` makes it: the kernels' torch twins (no Triton interpreter outside the tests)."""
    out = tmp_path / "b"
    with twins_on_cpu():
        rc = main(["bench", "--spec", "tiny", "--batch", "1,3", "--context", "8,20", "--iters", "3", "--warmup", "1",
                   "--repeats", "1", "--modes", "eager-rebuild,graph-rebuild,sglang,graphcap", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "graph-rebuild skipped: CUDA graphs need CUDA" in text
    assert "sglang skipped: sglang's Triton kernels need CUDA" in text
    lines = text.splitlines()
    assert lines[0] == CPU_SCOPE and "says nothing about GPU speed" in lines[0]  # first, and once
    assert text.count(CPU_SCOPE) == 1
    # only the columns these modes fill on a CPU: no GPU time, kernels, floor or speed-up over a mode not run
    # host ms neither: without an asynchronous device it is ms/iter again
    assert [h.strip() for h in lines[1].strip("|").split("|")] == [
        "batch", "ctx", "steps", "mode", "iter/s", "ms/iter", "p90 ms", "syncs/iter", "x eager-rebuild"]
    under = lines[lines.index(next(x for x in lines if x.startswith("legend: "))) - 1]
    assert under.startswith("| 3 ") and "no regression" in text and "no files written" not in text
    assert "note: syncs/iter:" in text and "kernels/iter" not in text
    data = json.loads((out / "bench.json").read_text())
    rows = [BenchRow(**r) for r in data["rows"]]  # exactly the record's fields, no more, no fewer
    assert {(r.batch, r.context, r.mode) for r in rows} == {
        (b, c, m) for b in (1, 3) for c in (8, 20) for m in ("eager-rebuild", "graphcap")}
    for r in rows:
        assert r.samples == 3 and r.wall_ms > 0 and r.gpu_ms is None and r.floor_ms is None
        assert r.kernels_per_iter is None and "CPU" in r.kernels_how
        assert r.syncs_per_iter == (1 if r.mode == "eager-rebuild" else 0) and ".item()" in r.syncs_how
        assert (r.x_eager_rebuild is not None) == (r.mode == "graphcap")
    assert "backend eager (CUDA graphs need CUDA)" in {r.note for r in rows}
    with open(out / "bench.csv") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == [x.name for x in dataclasses.fields(BenchRow)] and len(list(reader)) == len(rows)
    md = (out / "bench.md").read_text().splitlines()
    assert md[0].startswith("# graphcap bench") and md[2] == CPU_SCOPE and "copy bandwidth" not in "\n".join(md)
    env = data["environment"]
    assert env["spec_hash"] == load_spec("tiny").hash and data["config"]["spec"] == "tiny"
    assert env["torch_threads"] == 1 and "commit" in env


@cpu_only
@pytest.mark.subprocess
def test_a_cpu_run_prints_no_profiler_lines(tmp_path):
    """The host-read count's torch.profiler makes Kineto log every start and stop on stderr (`USDT: ...
    profiler_start`), between the table's lines: a CPU run turns that log off. A process of its own, as a user's run
    (Kineto reads the setting once per process), without Triton's interpreter, as outside the tests."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KINETO_LOG_LEVEL")}
    r = subprocess.run([sys.executable, "-m", "graphcap.cli", "bench", "--spec", "tiny", "--batch", "1", "--context",
                        "8", "--iters", "1", "--warmup", "0", "--repeats", "1", "--modes", "eager-rebuild,graphcap"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines()[0] == CPU_SCOPE and "| eager-rebuild" in r.stdout
    assert r.stdout.splitlines()[-1].startswith("note: no files written (--out DIR writes")  # without --out
    assert "profiler_start" not in r.stdout + r.stderr and "USDT" not in r.stdout + r.stderr


@pytest.mark.parametrize("argv, message", [
    (["--modes", "fast"], "unknown mode 'fast'"),
    (["--batch", "0"], "expected positive integers"),
    (["--batch", "x"], "expected comma-separated integers"),
    (["--batch", "64"], "exceeds max_slots 16"),
    (["--context", "4096"], "--context 4096 plus the 28 tokens"),  # (1 + 2 + 4) x (3 + 1): --warmup 1, --iters 4
    (["--iters", "200", "--batch", "1"], "exceeds its max_context 128; it fits with one of --iters <= 27"),
    (["--graphcap-backend", "fast"], "is not one of"),
    (["--modes", "graphcap-per-bucket,graphcap", "--graphcap-backend", "eager"], "backend 'eager' compiles nothing"),
    (["--no-such-option"], "unrecognized arguments"),
])
def test_bad_options_exit_2_with_one_line(argv, message, capsys):
    # explicit iteration counts: the defaults differ with and without CUDA
    assert main(["bench", "--spec", "tiny", "--iters", "4", "--warmup", "1", *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and len(captured.err.strip().splitlines()) == 1 and captured.out == ""


def test_graphcap_variants_change_one_thing_each_and_run_only_by_name():
    """graphcap's default: one compile for every bucket, the skinny GEMM by shape class (cuBLAS elsewhere), the
    layer's small ops as graphcap's kernels, layer regions; graphcap-per-bucket is the same loop and backend with
    dynamic_batch off, graphcap-skinny-gemm the same with the skinny GEMM for every shape at every batch,
    graphcap-skinny-4rows for every shape up to 4 rows, graphcap-inlined-layers the same with its layers
    inlined (no nested compile regions), graphcap-torch-ops the same with the small ops as torch ops Inductor fuses,
    graphcap-qnorm-kernel and graphcap-two-head-proj the same less one kernel-count lever each - there to price a
    choice in one run, never in the default mode set. Their compiles do not share a cache key."""
    spec = load_spec("tiny")
    cfg = _config("--spec", "tiny", "--batch", "2,3", "--iters", "1", "--modes",
                  "graphcap-per-bucket,graphcap-skinny-gemm,graphcap-skinny-4rows,graphcap-inlined-layers,"
                  "graphcap-torch-ops,graphcap-qnorm-kernel,graphcap-two-head-proj,graphcap",
                  "--graphcap-backend", "compile")
    st = make_target_state(spec, [5, 9, 20], [30, 30, 30], seed=1)
    modes = build_modes(cfg, FrozenKVDraft(spec, seed=2), st, spec.capture.steps, [])
    assert [(m.name, m.runner.backend, m.runner.dynamic_batch, m.runner.fn.ops.name, m.runner.fn.layer_regions)
            for m in modes] == [
        ("graphcap-per-bucket", "compile", False, "layer-kernels-gemm-by-shape", True),
        ("graphcap-skinny-gemm", "compile", True, "layer-kernels-skinny-gemm", True),
        ("graphcap-skinny-4rows", "compile", True, "layer-kernels", True),
        ("graphcap-inlined-layers", "compile", True, "layer-kernels-gemm-by-shape", False),
        ("graphcap-torch-ops", "compile", True, "torch", True),
        ("graphcap-qnorm-kernel", "compile", True, "layer-kernels-qnorm-kernel", True),
        ("graphcap-two-head-proj", "compile", True, "layer-kernels-two-head-proj", True),
        ("graphcap", "compile", True, "layer-kernels-gemm-by-shape", True)]
    assert len({m.runner._compile.cache_key() for m in modes}) == 8
    # the one compile sized for the spec's largest bucket (as a server capturing them all), not the run's largest
    assert {m.runner._compile.compile_max for m in modes if m.runner.dynamic_batch} == {spec.capture.buckets[-1]}
    assert max(options.buckets_for(cfg)) < spec.capture.buckets[-1]
    assert not set(options.VARIANTS) & set(_config("--spec", "tiny", "--iters", "4").modes)


def test_only_the_buckets_the_measured_batches_use_are_captured():
    """Capturing costs compile time per bucket: a run captures the smallest spec bucket >= each measured batch, and
    nothing else (a batch above every bucket gets a bucket of its own size)."""
    rng = random.Random(3)
    for _ in range(50):
        cfg = _config("--spec", "gemma4-31b-assistant", "--iters", "4", "--warmup", "1",
                      "--batch", ",".join(map(str, rng.sample(range(1, 100), rng.randint(1, 6)))))
        spec_b = cfg.spec.capture.buckets
        got = options.buckets_for(cfg)
        assert list(got) == sorted(set(got))
        for b in cfg.batches:  # every batch has a bucket that holds it: a spec bucket, or its own when above all
            g = min(x for x in got if x >= b)
            assert g in spec_b or (g == b and b > spec_b[-1])
        for g in got:  # and every captured bucket is the one some batch dispatches to
            below = max([x for x in spec_b if x < g], default=0)
            assert any(below < b <= g for b in cfg.batches)


@cpu_only
def test_sglang_mode_plans_every_layers_splits_as_sglang_does():
    """sglang plans splits with one `num_kv_head` - Gemma 4's full layers' (TritonAttnBackend.__init__,
    `_apply_gemma4_attention_overrides`) - and every layer's decode reads the full rows' plan (`forward_decode` passes
    `forward_metadata.num_kv_splits`). Gemma 4 31B's head counts (32 query, 16 sliding / 4 full KV heads) on an
    H200's 132 SMs, rows even enough that the SM count and heads decide; sglang's own `get_num_kv_splits_triton` as
    its backend calls it, under Triton's interpreter."""
    for name in ("decode_attention", "kv_indices", "metadata"):
        pytest.importorskip(f"sglang.kernels.ops.attention.{name}")
    from sglang.kernels.ops.attention.metadata import get_num_kv_splits_triton

    from graphcap.bench.sglang_ops import MAX_KV_SPLITS, SglangAttention

    spec = load_spec("tiny")
    lens = [100, 104, 110, 101, 120, 105]
    st = make_target_state(spec, lens, 128, seed=3, kv=False)
    wb = WindowBuffers.from_spec(spec, st.req_to_token, st.full_to_swa)
    heads, cores = 32, 132
    pools = {lt: (torch.zeros(8, kv, 4), torch.zeros(8, kv, 4)) for lt, kv in (("sliding", 16), ("full", 4))}
    att = SglangAttention(wb, pools, heads, 8, opaque=False, cores=cores)
    t_lens = torch.tensor(lens, dtype=torch.int32)
    att.rebuild(st.slots, t_lens)

    def sglang_plan(seq_lens: torch.Tensor, num_kv_head: int) -> list[int]:  # TritonAttnBackend.get_num_kv_splits
        out = torch.empty(len(seq_lens), dtype=torch.int32)
        get_num_kv_splits_triton[(1,)](out, seq_lens, len(seq_lens), 1, heads, num_kv_head, MAX_KV_SPLITS, cores,
                                       MAX_NUM_SEQ=256)
        return out.tolist()

    full = sglang_plan(t_lens, 4)
    window = sglang_plan(t_lens.clamp(max=spec.window), 4)
    assert att.splits["full"][:6].tolist() == full
    assert att.splits["sliding"][:6].tolist() == window  # computed as sglang computes it (and read by nothing)
    read = {}
    att.decode = lambda q, k, v, indptr, indices, splits, *a: read.setdefault(k.shape[1], splits[:6].tolist())
    for src in att.sources().values():
        src.attend(torch.zeros(6, heads, 4), 1.0)
    assert read == {16: full, 4: full}  # both layer types decode with the full rows' plan
    # the test tells the rules apart: the sliding layers' own heads or window rows would give other counts
    assert sglang_plan(t_lens, 16) != full and window != full


def test_time_call_host_clock_brackets_the_call_not_the_event_records(monkeypatch):
    """With CUDA: e0.record(), t0, the call, t1, e1.record(), sync, t2 - host time is the call alone."""
    from graphcap.bench import timing

    log = []

    class Event:
        def __init__(self, enable_timing: bool) -> None:
            pass

        def record(self) -> None:
            log.append("record")

        def elapsed_time(self, other) -> float:
            return 1.0

    clock = iter(range(100))
    monkeypatch.setattr(timing.torch.cuda, "Event", Event)
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: log.append("sync"))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: log.append("clock") or next(clock))
    s = timing.time_call(lambda: log.append("call"), cuda=True)
    assert log == ["record", "clock", "call", "clock", "record", "sync", "clock"]
    assert (s.host_ms, s.wall_ms, s.gpu_ms) == (1e3, 2e3, 1.0)


@cpu_only
def test_a_failed_bucket_leaves_graphcap_without_speed_ups_and_says_why(tmp_path, monkeypatch):
    """DraftGraphs runs a bucket whose capture failed eagerly: a mode with one gives no speed-ups, and its rows say
    which bucket and why."""
    import graphcap.engine.bucket_graph as bucket_graph

    real = bucket_graph.record_bucket

    def record(inputs, rec, *a, **kw):
        if rec.batch_size == 4:
            rec.status, rec.reason = "failed", "RuntimeError: forced"
            return None, None
        return real(inputs, rec, *a, **kw)

    monkeypatch.setattr(bucket_graph, "record_bucket", record)
    out = tmp_path / "b"
    with twins_on_cpu():  # the run's bookkeeping is the point, not the kernels
        assert main(["bench", "--spec", "tiny", "--batch", "1,3", "--context", "8", "--iters", "2", "--warmup", "1",
                     "--repeats", "1", "--modes", "eager-rebuild,graphcap", "--graphcap-backend", "eager",
                     "--out", str(out)]) == 0
    rows = [BenchRow(**r) for r in json.loads((out / "bench.json").read_text())["rows"]]
    for r in rows:
        if r.mode == "graphcap":
            assert r.x_eager_rebuild is None
            assert "bucket 4 not captured (RuntimeError: forced), ran eagerly" in r.note
        else:
            assert r.note == ""


def test_no_speed_up_over_a_baseline_that_lost_its_graphs(monkeypatch):
    from graphcap.bench import runner
    from graphcap.bench.counting import Count
    from graphcap.bench.timing import Sample

    cfg = _config("--spec", "tiny", "--iters", "4", "--warmup", "1")
    modes = []
    for name, ms in (("eager-rebuild", 4.0), ("sglang", 3.0), ("graphcap", 1.0)):
        m = runner.Mode(name, None, name, samples=[Sample(ms, ms, None)] * 3)
        m.syncs = m.kernels = Count(0, "")
        modes.append(m)
    lost = {"sglang": "bucket 8 not captured (OutOfMemoryError), ran eagerly"}
    monkeypatch.setattr(runner, "graph_problem", lambda r: lost.get(r, ""))
    rows = {r.mode: r for r in runner._rows(modes, 1, 8, 3, 16, None, cfg)}
    g = rows["graphcap"]
    assert g.x_eager_rebuild == 4.0 and g.x_sglang is None and "no speed-up over sglang" in g.note
    assert "graphs lost" in rows["sglang"].note and "OutOfMemoryError" in rows["sglang"].note
    lost = {"graphcap": "bucket 1 not captured (x), ran eagerly"}
    rows = {r.mode: r for r in runner._rows(modes, 1, 8, 3, 16, None, cfg)}
    assert rows["graphcap"].x_eager_rebuild is None and rows["graphcap"].x_sglang is None
    assert "graphs lost" in rows["graphcap"].note


def test_sync_count_runs_the_call_with_the_collector_off_and_restores_it(device):
    """A cycle collected mid-call can free earlier captures' CUDA memory, and the allocator syncs for that: the count
    is of the call's own syncs, so the collector is off while it runs (and on again after, as it was)."""
    import gc

    seen = []
    x = torch.randn(4, device=device)
    assert gc.isenabled()
    assert count_syncs(lambda: seen.append(gc.isenabled()) or (x * 2).sum().item(), device == "cuda").value == 1
    assert seen == [False] and gc.isenabled()




def test_server_compile_sizes_every_bench_capture_as_a_server_does():
    """The benches' one rule for sizing their captures (graphcap bench, capture_cost, profile_iteration): a compiled
    backend's one compile sized for the spec's largest bucket whatever subset they capture (or for a captured bucket
    above it), one compile per bucket when asked, nothing for a backend that compiles nothing - and for_loop takes
    each."""
    spec = options.load_spec("tiny")
    top = max(spec.capture.buckets)
    assert options.server_compile(spec, (1,), "inductor-cudagraph") == {"compile_max_batch": top}
    assert options.server_compile(spec, (2, top + 3), "compile") == {"compile_max_batch": top + 3}
    assert options.server_compile(spec, (1,), "compile", per_bucket=True) == {"dynamic_batch": False}
    assert options.server_compile(spec, (1,), "cudagraph") == {} == options.server_compile(spec, (1,), "eager")
    with twins_on_cpu():
        st = make_target_state(spec, [5, 9], [30, 30], device="cpu")
        wb = WindowBuffers.from_spec(spec, st.req_to_token, st.full_to_swa)
        loop = DraftLoop(FrozenKVDraft(spec, seed=1), wb, st.k_swa, st.v_swa, st.k_full, st.v_full)
        for backend in ("compile", "eager"):
            DraftGraphs.for_loop(loop, CaptureOptions(backend=backend, buckets=(1, 2), manifest_path=None,
                                                      **options.server_compile(spec, (1, 2), backend)))

