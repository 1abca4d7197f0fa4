"""Experiment switches for lab/reduce_overhead (issue 44), active in every Python process that has this folder on
PYTHONPATH - sglang's scheduler runs in a process of its own, so an in-process patch would not reach it. Each switch
acts only where its variable is set; with none set nothing is imported or changed. Then the image's own
sitecustomize, if there is one further down sys.path, runs as it would have.

- GRAPHCAP_LAB_ALLOW=reduce-overhead[,...]: graphcap's sglang plugin stops refusing these backends
  (`graphcap.sglang.config.UNSERVED_BACKENDS` loses them as the module is imported, so the launcher's
  check and bench/sglang_engine.py's --backends both let them through). For this experiment only.
- GRAPHCAP_LAB_INDUCTOR="force_cudagraph_sync=1,cudagraph_trees=0": `torch._inductor.config.triton` options set
  as Inductor's config is imported (ints; 0/1 for the booleans). `force_cudagraph_sync`: a device sync after every
  CUDA-graph-tree replay; `cudagraph_trees=0`: Inductor's older one-graph-per-function cudagraphify, no shared tree
  pool; `fast_path_cudagraph_asserts=1`: the tree's invariants checked around every replay. (site reports a bad
  value on stderr and goes on; lab/reduce_overhead/engine_case.py refuses it before anything starts.)
- GRAPHCAP_LAB_PROBE=DIR: one JSON line per event to DIR/probe-<pid>.jsonl, written and flushed at once (sglang
  kills its scheduler on an error, so nothing is buffered): around each graphcap draft call in sglang's scheduler,
  the current stream, the CUDA-graph tree's stream and counters (warm-ups, re-records, checkpoints, graphs recorded),
  Dynamo's counters (cudagraph skips, unique graphs, graph breaks) and the scheduler's host lengths.
- GRAPHCAP_LAB_SYNC=1 (with the probe): `torch.cuda.synchronize()` at the phase edges - before the draft (earlier
  work), after graphcap's replay (`iterate`), after the draft's tail (sglang's tree kernel), after sglang's verify -
  each recorded as a probe event, so the first sync that raises names the phase whose kernels faulted; the host
  lengths are then also checked against the device's (`seq_lens_sum`/`seq_lens_cpu` against `seq_lens`).
- GRAPHCAP_LAB_KEEP_CUBLAS=1: CUDA-graph trees stop clearing cuBLAS's cached workspaces around their warm-ups and
  recordings (`torch._inductor.cudagraph_trees.clear_cublass_cache` does nothing), so a graph captured earlier
  (sglang's) keeps the workspace it embeds (repro_cublas_workspace.py shows the clear freeing it).
- GRAPHCAP_LAB_RECAPTURE=1 (issue 54's capture order): once graphcap's runtime has captured its draft (CUDA-graph
  trees recorded for every bucket), sglang's target graphs are captured again (`model_runner.init_cuda_graphs()`), so
  no graph that serves was captured before a tree cleared cuBLAS's workspaces; then the trees are sealed: a tree
  warm-up, recording or workspace clear after start-up raises (a late re-record is an error, never a silent fault).
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
# graphcap's plugin modules; the crash commit (5f67d6c) kept them in graphcap.integrations
CONFIG_MODULES = ("graphcap.sglang.config", "graphcap.integrations.sglang_config")
RUNTIME_MODULES = ("graphcap.sglang.runtime", "graphcap.integrations.sglang_runtime")
_AFTER_IMPORT: dict[str, list] = {}  # module name -> callbacks run once it is imported


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs callbacks on a watched module right after its code ran (its first import), then steps aside."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _AFTER_IMPORT:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _Loader(spec.loader, _AFTER_IMPORT.pop(fullname))
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, callbacks) -> None:
        self.inner, self.callbacks = inner, callbacks

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        for cb in self.callbacks:
            cb(module)


def _after_import(name: str, cb) -> None:
    if name in sys.modules:
        cb(sys.modules[name])
    else:
        _AFTER_IMPORT.setdefault(name, []).append(cb)


def _note(msg: str) -> None:
    print(f"[lab reduce_overhead pid {os.getpid()}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------------------
# GRAPHCAP_LAB_ALLOW


def _allow(module) -> None:
    allowed = {b.strip() for b in os.environ["GRAPHCAP_LAB_ALLOW"].split(",") if b.strip()}
    module.UNSERVED_BACKENDS = tuple(b for b in module.UNSERVED_BACKENDS if b not in allowed)
    _note(f"graphcap refusal lifted for {sorted(allowed)} (UNSERVED_BACKENDS now {module.UNSERVED_BACKENDS})")


# ----------------------------------------------------------------------------------------------------------------
# GRAPHCAP_LAB_INDUCTOR


def parse_inductor(text: str) -> dict[str, int]:
    """"a=1,b=0" -> {"a": 1, "b": 0}; a clear error naming the item that is not name=int."""
    out = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip().lstrip("-").isdigit():
            raise ValueError(f"GRAPHCAP_LAB_INDUCTOR: expected name=int items, got {item!r} in {text!r}")
        out[name.strip()] = int(value)
    return out


def _inductor(module) -> None:
    for name, value in parse_inductor(os.environ["GRAPHCAP_LAB_INDUCTOR"]).items():
        if not hasattr(module.triton, name):
            raise ValueError(f"GRAPHCAP_LAB_INDUCTOR: torch._inductor.config.triton has no option {name!r}")
        old = getattr(module.triton, name)
        setattr(module.triton, name, type(old)(value) if isinstance(old, (bool, int)) else value)
        _note(f"torch._inductor.config.triton.{name} = {getattr(module.triton, name)!r}")


def _keep_cublas(module) -> None:
    skipped = [0]

    def clear_cublass_cache() -> None:
        skipped[0] += 1
        if skipped[0] == 1:
            _note("cudagraph_trees.clear_cublass_cache skipped (GRAPHCAP_LAB_KEEP_CUBLAS): workspaces kept")

    module.clear_cublass_cache = clear_cublass_cache  # clear_cublas_manager looks it up at each call


# ----------------------------------------------------------------------------------------------------------------
# GRAPHCAP_LAB_PROBE / GRAPHCAP_LAB_SYNC


class Probe:
    def __init__(self, directory: str, sync: bool) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"probe-{os.getpid()}.jsonl")
        self.sync, self.calls = sync, 0

    def event(self, **rec) -> None:
        rec.update(pid=os.getpid(), t=time.time())
        with open(self.path, "a") as f:
            f.write(json.dumps(rec, default=repr) + "\n")
            f.flush()

    def edge(self, phase: str) -> None:
        """GRAPHCAP_LAB_SYNC: a device sync at a phase edge; the probe says which edge raised."""
        if not self.sync:
            return
        import torch

        try:
            torch.cuda.synchronize()
        except Exception as e:
            self.event(event="sync-failed", phase=phase, call=self.calls, error=f"{type(e).__name__}: {e}")
            raise
        self.event(event="sync-ok", phase=phase, call=self.calls)

    def state(self) -> dict:
        import torch

        out = {"current_stream": torch.cuda.current_stream().cuda_stream,
               "default_stream": torch.cuda.default_stream().cuda_stream}
        try:
            from torch._inductor import cudagraph_trees as ct

            m = ct.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
        except Exception as e:  # another torch's layout: say so, keep serving
            m, out["tree_error"] = None, repr(e)
        if m is not None:
            out["tree"] = {"stream": m.stream.cuda_stream, "path_state": str(m.path_state),
                           "warmed_up_functions": len(m.warmed_up_functions),
                           "re_records": m.debug_fail_counter, "checkpoints": m.debug_checkpointing_counter,
                           "rerecord_counts": sum(sum(v.values()) for v in m.num_rerecord.values()),
                           "current_gen": m.current_gen}
        try:
            from torch._dynamo.utils import counters

            out["dynamo"] = {"cudagraph_skips": counters["inductor"]["cudagraph_skips"],
                             "unique_graphs": counters["stats"]["unique_graphs"],
                             "graph_breaks": sum(counters["graph_break"].values())}
        except Exception as e:
            out["dynamo_error"] = repr(e)
        return out

    def lengths(self, batch) -> dict:
        """The scheduler's host lengths, and (GRAPHCAP_LAB_SYNC only: a read-back) the device's."""
        out = {"seq_lens_sum": getattr(batch, "seq_lens_sum", None)}
        cpu = getattr(batch, "seq_lens_cpu", None)
        out["seq_lens_cpu"] = cpu.tolist() if cpu is not None else None
        if self.sync:
            dev = batch.seq_lens.tolist()
            out["seq_lens_device"] = dev
            out["host_matches_device"] = ((out["seq_lens_sum"] in (None, sum(dev)))
                                          and (out["seq_lens_cpu"] in (None, dev)))
        return out


_PROBE: Probe | None = None


def _probe_runtime(module) -> None:
    """Wrap GraphcapDraftRuntime.draft / iterate (graphcap's sglang runtime module) with the probe."""
    cls = module.GraphcapDraftRuntime
    draft, iterate = cls.draft, cls.iterate

    def probed_draft(self, batch, fallback):
        p = _PROBE
        p.calls += 1
        p.event(event="draft-start", call=p.calls, batch=len(batch.reqs), backend=self.options.backend,
                lengths=p.lengths(batch), **p.state())
        p.edge("before-draft")
        result = draft(self, batch, fallback)
        p.edge("after-draft-tail")
        p.event(event="draft-end", call=p.calls, **p.state())
        return result

    def probed_iterate(self, batch):
        out = iterate(self, batch)
        _PROBE.edge("after-replay")
        return out

    cls.draft, cls.iterate = probed_draft, probed_iterate
    _note(f"probe on graphcap's draft calls -> {_PROBE.path} (sync at phase edges: {_PROBE.sync})")


def _probe_verify(module) -> None:
    """Wrap sglang's EAGLEWorkerV2.verify (FROZEN_KV_MTP's verify) with a sync edge after it."""
    cls = module.EAGLEWorkerV2
    verify = cls.verify

    def probed_verify(self, *args, **kwargs):
        out = verify(self, *args, **kwargs)
        _PROBE.edge("after-verify")
        return out

    cls.verify = probed_verify


# ----------------------------------------------------------------------------------------------------------------
# GRAPHCAP_LAB_RECAPTURE


class LateTreeWork(RuntimeError):
    """A CUDA-graph tree warmed up, recorded or cleared cuBLAS's workspaces after start-up."""


def seal_trees() -> None:
    """From now on every tree warm-up, recording and cuBLAS workspace clear raises LateTreeWork, named."""
    from torch._inductor import cudagraph_trees as ct

    def refuse(what):
        def late(*args, **kwargs):
            if _PROBE is not None:
                _PROBE.event(event="late-tree-work", what=what)
            raise LateTreeWork(f"graphcap lab: {what} after start-up: the CUDA-graph trees were sealed once sglang's "
                               "target graphs were captured again (a late re-record would free their cuBLAS "
                               "workspace)")
        return late

    ct.CUDAGraphTreeManager.record_function = refuse("a CUDA-graph tree recording")
    ct.CUDAGraphTreeManager.run_eager = refuse("a CUDA-graph tree warm-up")
    ct.clear_cublass_cache = refuse("a CUDA-graph tree's cuBLAS workspace clear")
    _note("CUDA-graph trees sealed: a warm-up, recording or cuBLAS workspace clear from now on raises")


def _recapture_runtime(module) -> None:
    """GraphcapDraftRuntime.capture, then sglang's target graphs captured again and the trees sealed."""
    cls = module.GraphcapDraftRuntime
    capture = cls.capture

    def capture_then_target(self):
        capture(self)
        if self.options.backend != "reduce-overhead":
            return
        import torch

        runner = self.worker.target_worker.model_runner
        old = runner.decode_cuda_graph_runner
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.init_cuda_graphs()
        torch.cuda.synchronize()
        new = runner.decode_cuda_graph_runner
        _note(f"sglang's target graphs captured again after graphcap's trees in {time.perf_counter() - t0:.1f} s "
              f"(runner {'replaced' if new is not old else 'NOT replaced'}, buckets "
              f"{list(getattr(new, 'capture_bs', []) or [])})")
        if _PROBE is not None:
            _PROBE.event(event="target-recaptured", seconds=time.perf_counter() - t0, replaced=new is not old)
        seal_trees()

    cls.capture = capture_then_target


# ----------------------------------------------------------------------------------------------------------------


def _install() -> None:
    global _PROBE
    if os.environ.get("GRAPHCAP_LAB_ALLOW"):
        for name in CONFIG_MODULES:
            _after_import(name, _allow)
    if os.environ.get("GRAPHCAP_LAB_INDUCTOR"):
        parse_inductor(os.environ["GRAPHCAP_LAB_INDUCTOR"])  # a bad value fails every process at once, named
        _after_import("torch._inductor.config", _inductor)
    if os.environ.get("GRAPHCAP_LAB_KEEP_CUBLAS") == "1":
        _after_import("torch._inductor.cudagraph_trees", _keep_cublas)
    if os.environ.get("GRAPHCAP_LAB_RECAPTURE") == "1":
        for name in RUNTIME_MODULES:
            _after_import(name, _recapture_runtime)
    if os.environ.get("GRAPHCAP_LAB_PROBE"):
        _PROBE = Probe(os.environ["GRAPHCAP_LAB_PROBE"], os.environ.get("GRAPHCAP_LAB_SYNC") == "1")
        for name in RUNTIME_MODULES:
            _after_import(name, _probe_runtime)
        _after_import("sglang.srt.speculative.eagle_worker_v2", _probe_verify)
    if _AFTER_IMPORT:
        sys.meta_path.insert(0, _AfterImport())


def _chain() -> None:
    """The sitecustomize this one shadows (the image's, in site-packages), run as it would have been."""
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [p for p in sys.path
                                                                       if os.path.abspath(p or ".") != _HERE])
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


import importlib.util  # noqa: E402 - used by _chain only

if __name__ == "sitecustomize":  # as Python's site runs it; engine_case.py imports it under another name for
    _install()                   # parse_inductor alone
    _chain()
