"""Host microseconds of one served draft call's graphcap half (`GraphcapDraftRuntime.iterate`), on any machine.

What sglang's scheduler thread spends in graphcap per draft before the replay's launch returns: the batch checks,
the rebuild check, the dispatch, the input copies, sglang's forward context where it is entered, the replay call and
the output views. The iteration itself is a graph that launches nothing (on a CPU there is no CUDA graph; on a GPU
the launch is not what this measures), so every bucket takes the manual-graph backends' path, as the plugin's
default `cudagraph` backend does. sglang's real `set_forward_context` is what the runtime enters where it does.
Steady state: every row's window is built already, so no call rebuilds (a rebuild syncs, by design).

Modes, in the same run: `default` (the served path) and `check` (GRAPHCAP_SGLANG_CHECK=1: every check, the address
guard each replay, the lengths against the device with a sync). Another commit's numbers: its checkout first on
PYTHONPATH, with a copy of this script from a commit of the same package layout (the imports name the modules).

    python bench/draft_host_time.py --batches 1,8,32
"""
from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

import torch
from tabulate import tabulate

from graphcap.bench.timing import call_us
from graphcap.engine.capture import DraftGraphs
from graphcap.engine.options import CaptureOptions
from graphcap.sglang.runtime import GraphcapDraftRuntime, bind_window
from graphcap.sglang.settings import DraftCaptureOptions, PluginSettings
from graphcap.engine.iteration import DraftOutput

HIDDEN = 2816  # the Gemma 4 assistant's backbone width (the hidden state copied in per row)
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


class NoLaunch:
    """Stands in for a recorded `torch.cuda.CUDAGraph`: a replay that launches nothing."""

    def replay(self) -> None:
        pass


def forward_context():
    """sglang's own forward-context switch, as the runtime's loop enters it; a no-op where sglang is absent."""
    try:
        from sglang.srt.model_executor.forward_context import ForwardContext, set_forward_context
    except Exception:  # noqa: BLE001 - any import problem: time without it, and say so
        return None
    import contextlib

    ctx = ForwardContext(attn_backend=None)

    @contextlib.contextmanager
    def enter():
        prev = set_forward_context(ctx)
        try:
            yield
        finally:
            set_forward_context(prev)
    return enter


def build(device: str, check: bool, rows: int, width: int, window: int):
    g = torch.Generator().manual_seed(0)
    r2t = (1 + torch.randperm(rows * width, generator=g)).reshape(rows, width).to(torch.int32).to(device)
    f2s = torch.cat([torch.zeros(1, dtype=torch.int64), 1 + torch.randperm(rows * width, generator=g)]).to(device)
    wb = bind_window(r2t, window, f2s, max_accepted=4)
    # the check mode as the runtime's settings (what GRAPHCAP_SGLANG_CHECK sets): no environment touched
    rt = GraphcapDraftRuntime(SimpleNamespace(speculative_num_steps=3), DraftCaptureOptions(enabled=True), wb, None,
                              settings=PluginSettings(check=check))

    def iteration(slots, accepted, tokens, hidden):
        return DraftOutput(torch.stack([tokens, tokens, tokens], 1), hidden[:, :3].float(), hidden[:, :3].float(),
                           hidden)

    def example_inputs(b):
        return (torch.full((b,), wb.padding_slot, dtype=torch.int64, device=device),
                torch.zeros(b, dtype=torch.int32, device=device), torch.zeros(b, dtype=torch.int64, device=device),
                torch.zeros(b, HIDDEN, dtype=torch.bfloat16, device=device))

    fn = rt.tracker.in_iteration(iteration) if hasattr(rt.tracker, "in_iteration") else iteration
    graphs = DraftGraphs(fn, padding_slot=wb.padding_slot, example_inputs=example_inputs,
                         static_tensors={**wb.static_tensors(), "pending_accepts": rt.tracker.pending},
                         options=CaptureOptions(backend="eager", buckets=tuple(BUCKETS), manifest_path=None))
    graphs.capture()
    for size in BUCKETS:
        bucket = graphs.bucket_graph(size)
        bucket.graph, bucket.outputs = NoLaunch(), iteration(*bucket.inputs)
        bucket.views.clear()
    rt.attach(graphs)
    enter = forward_context()
    if enter is not None:
        rt.loop = SimpleNamespace(context=enter)
    return rt, wb, enter is not None


def batch_of(rt, wb, b: int, device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(wb.max_slots, generator=g)[:b].tolist()
    lens = torch.randint(wb.window + 4, 200, (b,), generator=g)
    reqs = [SimpleNamespace(rid=f"b{b}-r{s}", kv=SimpleNamespace(req_pool_idx=s)) for s in slots]
    batch = SimpleNamespace(reqs=reqs, seq_lens=lens.to(device), seq_lens_cpu=None, seq_lens_sum=None,
                            req_pool_indices=torch.tensor(slots, device=device),
                            spec_info=SimpleNamespace(bonus_tokens=torch.randint(0, 1000, (b,), generator=g).to(device),
                                                      hidden_states=torch.randn(b, HIDDEN, generator=g).to(
                                                          device, torch.bfloat16)))
    rt.iterate(batch)  # builds the rows: later calls only advance
    return batch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--iters", type=int, default=5000)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (the copies then launch: their launch is timed)")
    a = p.parse_args(argv)
    try:
        batches = [int(x) for x in a.batches.split(",") if x]
    except ValueError:
        p.error(f"--batches: {a.batches!r} is not a comma-separated list of ints")
    if not batches or min(batches) < 1 or max(batches) > BUCKETS[-1] or a.iters < 1:
        p.error(f"--batches each in 1..{BUCKETS[-1]}, --iters >= 1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows, with_ctx = [], False
    try:
        for mode in ("default", "check"):
            rt, wb, with_ctx = build(a.device, mode == "check", rows=max(BUCKETS) + 8, width=256, window=16)
            for b in batches:
                batch = batch_of(rt, wb, b, a.device, seed=b)
                med, p90 = call_us(lambda: rt.iterate(batch), a.iters)
                rows.append([mode, b, f"{med:.1f}", f"{p90:.1f}"])
    finally:
        torch.set_num_threads(threads)  # called in-process (the tests): the caller's thread count back
    commit = os.environ.get("GRAPHCAP_COMMIT", "?")
    print(f"graphcap {commit} from {os.path.dirname(sys.modules['graphcap'].__file__)}, torch {torch.__version__}, "
          f"device {a.device}, sglang forward context {'entered where the runtime enters it' if with_ctx else 'absent'}"
          f", {a.iters} calls each")
    print(tabulate(rows, headers=["mode", "batch", "median us", "p90 us"], stralign="right"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
