"""Deep checks against the real sglang runtime modules (0.5.23 in the venv; 0.5.18 with its directory in front of
PYTHONPATH), run in a fresh interpreter by tests/sglang/test_runtime.py (they import sglang's
scheduler, schedule batch, Triton backend and Frozen-KV MTP worker, with torchvision stubbed: see _sglang_env.py).
Run alone: `pytest -o python_files='check_*.py' tests/sglang_isolated`.

- the runtime hooks land on the real classes in a scheduler process, and without the flag nothing does;
- the hooked real methods still run sglang's own bodies and feed graphcap's bookkeeping (accepts, joins, evictions,
  the draft graphs captured at 1, 2 and 3 steps);
- the window graphcap keeps equals what sglang's own `update_sliding_window_buffer` (Triton backend) gathers, for
  random requests joining, being retracted, losing in-window SWA pages and advancing by random accepted counts, at
  1, 2 and 3 steps;
- the chain's tree inputs equal sglang's own `select_top_k_tokens` + `organize_draft_results` for topk == 1;
- what graphcap reads of sglang where the two versions differ (graphcap.sglang.compat), on the
  installed version's own classes and functions.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pkgutil
import random
import sys
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

pytest.importorskip("sglang", reason="the real sglang package is not installed")
pytestmark = pytest.mark.sglang

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _sglang_env import install_torchvision_stub  # noqa: E402

install_torchvision_stub()

import sglang.srt.managers.scheduler  # noqa: E402,F401  (a scheduler process has it imported)
from sglang.srt import plugins  # noqa: E402
from sglang.srt.managers.schedule_batch import ReqKvInfo, ScheduleBatch  # noqa: E402
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402
from sglang.srt.speculative import frozen_kv_mtp_worker_v2  # noqa: E402
from sglang.srt.speculative.frozen_kv_mtp_worker_v2 import FrozenKVMTPDraftWorker  # noqa: E402

from graphcap.sglang import plugin  # noqa: E402
from graphcap.sglang import compat as compat  # noqa: E402
from graphcap.sglang import config  # noqa: E402
from graphcap.sglang.settings import DRAFT_CAPTURE_ENV, DraftCaptureOptions  # noqa: E402
from graphcap.sglang import hooks as hooks  # noqa: E402
from graphcap.sglang.runtime import (  # noqa: E402
    GraphcapDraftRuntime, SlotTracker, bind_window, chain_tree_inputs)

VERSION = compat.sglang_version()
# Where the installed sglang keeps a request's pool row: on its always-present ReqKvInfo (0.5.23) or on the request,
# beside a ReqKvInfo of two fields made when it gets KV (0.5.18).
ROW_ON_KV = "req_pool_idx" in {f.name for f in dataclasses.fields(ReqKvInfo)}


def _req(rid: str, slot: int | None, **extra) -> SimpleNamespace:
    """A request as the installed sglang lays one out (its own ReqKvInfo), at pool row `slot`."""
    if ROW_ON_KV:  # 0.5.23
        kv = ReqKvInfo()
        kv.req_pool_idx = slot
        return SimpleNamespace(rid=rid, kv=kv, **extra)
    return SimpleNamespace(rid=rid, req_pool_idx=slot, kv=ReqKvInfo(kv_allocated_len=0, swa_evicted_seqlen=0),
                           **extra)


def _load_plugins(env: str | None) -> None:
    """sglang's load_plugins as a scheduler process runs it, with the plugin's variable `env` (None: unset) for the
    load alone: the environment is left as it was."""
    HookRegistry.reset()
    plugins._plugins_loaded = False
    plugin.STATE.runtime_hooks.clear()
    with mock.patch.dict(os.environ):
        if env is None:
            os.environ.pop(DRAFT_CAPTURE_ENV, None)
        else:
            os.environ[DRAFT_CAPTURE_ENV] = env
        plugins.load_plugins()


def _raw(target: str):
    owner, attr = target.rsplit(".", 1)
    obj = pkgutil.resolve_name(owner)
    raw = obj.__dict__[attr]
    return getattr(raw, "__func__", raw)


# -----------------------------------------------------------------------------------------------------------------
# Hooks on the real classes (applied once per process: sglang has no way to take them off)


def test_scheduler_process_without_the_flag_patches_nothing():
    """Whichever tests ran before (a test with the flag leaves the real classes hooked): loading the plugins without
    the flag registers only the argument hooks and leaves every runtime target as it found it."""
    found = {target: _raw(target) for target in config.RUNTIME_HOOKS}
    _load_plugins(None)
    assert set(HookRegistry._hooks) == set(config.ARG_HOOKS)
    for target, fn in found.items():
        assert _raw(target) is fn, target


def test_scheduler_process_with_the_flag_hooks_the_real_classes():
    _load_plugins(DraftCaptureOptions(enabled=True).to_json())
    for target in config.ARG_HOOKS + config.RUNTIME_HOOKS + (config.WORKER_SEED_HIDDEN,):
        assert target in HookRegistry._patched, f"sglang did not apply {target}"
        fn = _raw(target)
        assert hasattr(fn, "__wrapped__"), target
        assert fn.__wrapped__.__module__.startswith("sglang."), (target, fn.__wrapped__.__module__)
        assert fn.__wrapped__.__name__ == target.rsplit(".", 1)[1]


@pytest.fixture
def patched():
    """The flag's hooks applied once in this process (tests below may run alone, e.g. with -k)."""
    if not hasattr(_raw(config.BATCH_EVICT_SWA), "__wrapped__"):
        _load_plugins(DraftCaptureOptions(enabled=True).to_json())


class _Runtime:  # what the batch hooks need of a GraphcapDraftRuntime
    def __init__(self, tracker):
        self.tracker, self.active = tracker, True


def _window_buffers(rows=6, width=64, window=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    r2t = (1 + torch.randperm(rows * width, generator=g)).reshape(rows, width).to(torch.int32)
    f2s = torch.cat([torch.zeros(1, dtype=torch.int64), 1 + torch.randperm(rows * width, generator=g)])
    return bind_window(r2t, window, f2s, max_accepted=4)


def _outcome(fn, *args):
    """What a call did, comparably: the exception's type and message, or the result's type and draft tokens."""
    try:
        out = fn(*args)
    except Exception as e:  # sglang's own body may raise on this stub input; the hook must not change how
        return "raised", type(e).__name__, str(e)
    tokens = getattr(out, "draft_token", None)
    return "returned", type(out).__name__, None if tokens is None else tokens.tolist()


def test_hooked_draft_is_sglang_draft_without_a_runtime(patched):
    """Without a graphcap runtime the AROUND hook runs sglang's own body: the hooked draft does exactly what the
    unhooked one does (here on the idle path), whatever that is."""
    hooked = _raw(config.WORKER_DRAFT)
    assert hooked.__wrapped__ is not hooked

    def worker():
        return SimpleNamespace(topk=1, speculative_num_steps=3, speculative_num_draft_tokens=4, device="cpu")

    def batch():
        return SimpleNamespace(forward_mode=ForwardMode.IDLE)

    assert _outcome(FrozenKVMTPDraftWorker.draft, worker(), batch()) == _outcome(hooked.__wrapped__, worker(), batch())


def test_hooked_draft_extend_for_decode_records_accepts(patched):
    tracker = SlotTracker(_window_buffers())
    bs, n, hidden = 3, 4, 5
    worker = SimpleNamespace(device="cpu", speculative_num_draft_tokens=n, _graphcap_runtime=_Runtime(tracker),
                             _build_seed_draft_input=lambda tok, hid: ("seed", tok, hid))
    batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, seq_lens=torch.tensor([9, 4, 30]),
                            req_pool_indices=torch.tensor([4, 0, 2]))
    result = SimpleNamespace(accept_lens=torch.tensor([2, 1, 4]),
                             logits_output=SimpleNamespace(hidden_states=torch.randn(bs * n, hidden)),
                             next_draft_input=SimpleNamespace(bonus_tokens=torch.tensor([7, 8, 9])))
    FrozenKVMTPDraftWorker._draft_extend_for_decode(worker, batch, result)
    assert result.next_draft_input[0] == "seed"  # sglang's body ran
    assert tracker.pending.tolist()[:6] == [1, 0, 4, 0, 2, 0]


def test_hooked_draft_extend_for_prefill_marks_joins(patched):
    tracker = SlotTracker(_window_buffers())
    tracker.owner.update({1: "old", 3: "x"})
    reqs = [_req("a", 1)]
    worker = SimpleNamespace(_graphcap_runtime=_Runtime(tracker), _select_last_extend_hidden=lambda b, h: h,
                             _build_seed_draft_input=lambda tok, hid: "seed")
    batch = SimpleNamespace(forward_mode=ForwardMode.EXTEND, reqs=reqs)
    assert FrozenKVMTPDraftWorker._draft_extend_for_prefill(worker, batch, torch.zeros(1, 2), torch.zeros(1)) == "seed"
    assert tracker.owner == {3: "x"} and tracker.stats["joins"] == 1


def test_hooked_seed_rows_are_sglangs_own(patched):
    """The prefill's seed rows (config.WORKER_SEED_HIDDEN, hooked): with a graphcap runtime graphcap.sglang.seed's
    gather (no host sync), equal to the installed sglang's own `select_last_extend_hidden`; without one, sglang's."""
    from sglang.srt.speculative.frozen_kv_mtp_utils import select_last_extend_hidden

    assert hasattr(_raw(config.WORKER_SEED_HIDDEN), "__wrapped__")
    g = torch.Generator().manual_seed(5)
    for case in range(40):
        lens = (1 + torch.randint(0, 30, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g)).tolist()
        batch = SimpleNamespace(extend_lens=lens, batch_size=lambda n=len(lens): n)
        hidden = torch.randn(sum(lens), 6, generator=g)
        want = select_last_extend_hidden(batch, hidden)
        for runtime in (_Runtime(None), None):
            got = FrozenKVMTPDraftWorker._select_last_extend_hidden(SimpleNamespace(_graphcap_runtime=runtime), batch,
                                                                    hidden)
            assert torch.equal(got, want), (case, lens, runtime)


def test_the_trace_records_a_prefill_over_the_hooked_seed_with_the_installed_fields(patched, tmp_path):
    """graphcap's draft trace reads a prefill batch's `forward_mode`, `extend_num_tokens` and `prefix_lens` and a
    request's `seqlen`, which the installed sglang has, around the speculative worker's iteration, which the installed
    sglang has too (config.WORKER_ITERATION and the target's TARGET_ITERATION, methods taking the batch); around an
    iteration that calls the real (hooked) `_draft_extend_for_prefill` it records the batch and hands on sglang's
    seed, graphcap's join bookkeeping still done."""
    import importlib
    import inspect

    from sglang.srt.managers.schedule_batch import Req

    from graphcap.sglang.trace import DraftTrace

    assert {"extend_num_tokens", "prefix_lens", "reqs", "forward_mode"} <= {f.name for f in
                                                                          dataclasses.fields(ScheduleBatch)}
    assert isinstance(inspect.getattr_static(Req, "seqlen"), property)
    for target in (config.WORKER_ITERATION, config.TARGET_ITERATION):  # both take the ScheduleBatch second
        module, cls, method = target.rsplit(".", 2)
        iteration = getattr(getattr(importlib.import_module(module), cls), method)
        assert list(inspect.signature(iteration).parameters)[:2] == ["self", "batch"], target
    tracker = SlotTracker(_window_buffers())
    tracker.owner.update({2: "old"})
    worker = SimpleNamespace(_graphcap_runtime=_Runtime(tracker), _select_last_extend_hidden=lambda b, h: h,
                             _build_seed_draft_input=lambda tok, hid: "seed")
    batch = SimpleNamespace(forward_mode=ForwardMode.EXTEND, reqs=[_req("a", 2)], extend_num_tokens=300,
                            prefix_lens=[64])
    trace = DraftTrace(str(tmp_path), flush_every=16)
    seed = trace.around_iteration(lambda w, b: FrozenKVMTPDraftWorker._draft_extend_for_prefill(
        w, b, torch.zeros(1, 2), torch.zeros(1)), worker, batch)
    assert seed == "seed" and tracker.stats["joins"] == 1
    trace.flush()
    (rec,) = [json.loads(line) for line in open(trace.prefill_path)]
    assert (rec["rids"], rec["extend_tokens"], rec["cached_tokens"]) == (["a"], 300, 64)


def _swa_component():
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    return ComponentType.SWA


def test_hooked_evict_swa_resets_only_when_the_window_is_touched(patched):
    """sglang's own `_evict_swa` body moves the request's SWA frontier; graphcap's hook reads it where the installed
    sglang keeps it and marks the row stale exactly when the frontier reaches into graphcap's window [seq_len - W,
    seq_len). 0.5.23: the frontier set by the tree cache (a stand-in here: its eviction is a class of its own);
    0.5.18: sglang's own free_swa_out_of_window_slots computes it from the cache's window and page size."""
    tracker = SlotTracker(_window_buffers(window=8))
    rt = _Runtime(tracker)
    hooks._RUNTIMES.add(rt)
    try:
        req = _req("r", 2, cache_protected_len=0)
        frontier = {"upto": 0}
        freed = []
        cache = SimpleNamespace(supports_swa=lambda: True, is_chunk_cache=lambda: False, page_size=1,
                                sliding_window_size=8, swa_retain_floor=lambda r: None,
                                evict_sliding_windows=lambda r, pre_len, eviction_interval=1:
                                r.kv.set_evicted_seqlen(_swa_component(), frontier["upto"]))
        batch = SimpleNamespace(tree_cache=cache, req_to_token_pool=SimpleNamespace(
            req_to_token=torch.arange(6 * 64).reshape(6, 64)), token_to_kv_pool_allocator=SimpleNamespace(
            free_swa=lambda locs: freed.append(locs.tolist())))
        frontier["upto"] = 40  # seq_len 50, W 8: window is [42, 50): untouched (0.5.18: 49 - 8 = 41)
        ScheduleBatch._evict_swa(batch, req, 49)
        assert tracker.stale == set() and compat.swa_evicted_len(req) == (40 if ROW_ON_KV else 41)
        frontier["upto"], cache.sliding_window_size = 45, 4  # into the window (0.5.18: 49 - 4 = 45)
        ScheduleBatch._evict_swa(batch, req, 49)
        assert tracker.stale == {2} and tracker.stats["evictions_in_window"] == 1
        assert compat.swa_evicted_len(req) == 45
        if not ROW_ON_KV:  # sglang 0.5.18's own body freed the SWA slots of row 2 up to each frontier
            assert freed == [list(range(128, 128 + 41)), list(range(128 + 41, 128 + 45))]
    finally:
        hooks._RUNTIMES.discard(rt)


def test_retract_hook_forgets_retracted_rows(patched):
    tracker = SlotTracker(_window_buffers())
    rt = _Runtime(tracker)
    hooks._RUNTIMES.add(rt)
    try:
        reqs = [_req(r, s) for r, s in (("a", 0), ("b", 3), ("c", 5))]
        tracker.owner.update({0: "a", 3: "b", 5: "c"})
        batch = SimpleNamespace(reqs=list(reqs))

        def retract(b):
            b.reqs = [reqs[0]]
            return [reqs[1], reqs[2]], 0.5, []

        assert hooks.around_retract_decode(retract, batch)[0] == [reqs[1], reqs[2]]
        assert tracker.owner == {0: "a"}
        assert hasattr(_raw(config.BATCH_RETRACT), "__wrapped__")  # and this hook is what sglang's method runs
    finally:
        hooks._RUNTIMES.discard(rt)


def test_for_worker_names_what_it_cannot_serve():
    class TritonAttnBackend:
        sliding_window_size = 8

    opts = DraftCaptureOptions(enabled=True)
    with pytest.raises(compat.DraftCaptureConfigError, match=r"--speculative-eagle-topk must be 1, got 2"):
        GraphcapDraftRuntime.for_worker(SimpleNamespace(topk=2), opts)
    with pytest.raises(compat.DraftCaptureConfigError, match=r"draft runs on FlashInferAttnBackend"):
        GraphcapDraftRuntime.for_worker(SimpleNamespace(topk=1, draft_attn_backend=type("FlashInferAttnBackend", (), {})()), opts)
    translating = SimpleNamespace(kv_index_translator=SimpleNamespace(is_translating=True))  # 0.5.23's marker
    with pytest.raises(compat.DraftCaptureConfigError, match=r"unified KV pool"):
        GraphcapDraftRuntime.for_worker(SimpleNamespace(topk=1, draft_attn_backend=TritonAttnBackend(),
                                                        draft_model_runner=translating), opts)
    backend = TritonAttnBackend()
    backend._translate_kv_loc = lambda locs: locs  # 0.5.18's: the Triton backend's v2p hook
    with pytest.raises(compat.DraftCaptureConfigError, match=r"unified KV pool"):
        GraphcapDraftRuntime.for_worker(SimpleNamespace(topk=1, draft_attn_backend=backend,
                                                        draft_model_runner=SimpleNamespace()), opts)
    with pytest.raises(compat.SglangLayoutError, match=r"kv_index_translator \(sglang 0.5.23\) nor as the Triton "
                                                       r"backend's _translate_kv_loc \(sglang 0.5.18\)"):
        GraphcapDraftRuntime.for_worker(SimpleNamespace(topk=1, draft_attn_backend=TritonAttnBackend(),
                                                        draft_model_runner=SimpleNamespace()), opts)


class _CaptureRuntime:  # what around_init_cuda_graphs needs of a GraphcapDraftRuntime (weak-referenceable)
    def __init__(self, worker):
        self.worker, self.captured, self.active = worker, 0, True

    def capture(self):
        self.captured += 1


def _without_contexts(monkeypatch):
    """The draft worker's TP/PP/MoE context managers as no-ops (their names differ between the versions), and
    TpModelWorker.init_cuda_graphs (the target-shaped graphs) as a recorder."""
    for name in ("draft_tp_context", "draft_pp_context", "speculative_moe_backend_context",
                 "speculative_moe_a2a_backend_context"):
        if hasattr(frozen_kv_mtp_worker_v2, name):
            monkeypatch.setattr(frozen_kv_mtp_worker_v2, name, lambda *a, **k: contextlib.nullcontext())
    calls = []
    monkeypatch.setattr(frozen_kv_mtp_worker_v2.TpModelWorker, "init_cuda_graphs",
                        lambda self, **kw: calls.append(kw))
    return calls


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_hooked_init_cuda_graphs_captures_graphcaps_loop_at_every_step_count(patched, monkeypatch, steps):
    """sglang's own `FrozenKVMTPDraftWorker.init_cuda_graphs` (hooked) runs its TP/PP/MoE contexts and the target-shaped
    graphs, then `_capture_cuda_graphs` - which graphcap's hook points at its own capture, so graphcap captures its
    loop at 1 step too, where sglang 0.5.18's own `_capture_cuda_graphs` returns without a graph (next test)."""
    calls = _without_contexts(monkeypatch)
    server_args = SimpleNamespace()
    monkeypatch.setenv(DRAFT_CAPTURE_ENV, "")  # attach_options exports it: removed again after the test
    config.attach_options(server_args, DraftCaptureOptions(enabled=True))
    worker = SimpleNamespace(server_args=server_args, speculative_num_steps=steps, parallel_layout=None,
                             draft_model_runner=SimpleNamespace(tp_group=None),
                             draft_tp_context=lambda group: contextlib.nullcontext())
    made = []
    monkeypatch.setattr(GraphcapDraftRuntime, "for_worker",
                        classmethod(lambda cls, w, opts: made.append(_CaptureRuntime(w)) or made[-1]))
    FrozenKVMTPDraftWorker.init_cuda_graphs(worker)
    assert calls == [{"capture_decode_cuda_graph": False}]  # sglang's body ran
    assert len(made) == 1 and made[0].captured == 1 and hooks.runtime_of(worker) is made[0]
    assert "_capture_cuda_graphs" not in vars(worker)  # the shadowing attribute is gone again
    hooks._RUNTIMES.discard(made[0])


def test_sglangs_own_draft_graph_from_which_step_count():
    """What stock sglang graphs at one draft step, read off its own `_capture_cuda_graphs` (CUDA graphs on): 0.5.23
    goes on to capture (it next reads the target's device), 0.5.18 returns first (the draft then runs eagerly at 1
    step). graphcap's capture does not depend on it (the test above)."""
    def goes_on(steps: int) -> bool:
        worker = SimpleNamespace(speculative_num_steps=steps)  # no target_worker: reading it means it went on
        try:
            FrozenKVMTPDraftWorker._capture_cuda_graphs(worker)
        except AttributeError as e:
            assert "target_worker" in str(e)
            return True
        return False

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(frozen_kv_mtp_worker_v2, "cuda_graph_fully_disabled", lambda: False)
        assert goes_on(2) and goes_on(3)
        assert goes_on(1) == {"0.5.18": False, "0.5.23": True}[VERSION]


# -----------------------------------------------------------------------------------------------------------------
# What graphcap reads where the versions differ (sglang_compat), on the installed sglang's own objects


def test_slot_and_frontier_on_the_installed_request_layout():
    req = _req("a", 5)
    assert compat.slot_of(req) == 5 and compat.swa_evicted_len(req) == 0
    if ROW_ON_KV:  # 0.5.23: the frontier per component
        req.kv.set_evicted_seqlen(_swa_component(), 17)
    else:  # 0.5.18: one field; and no ReqKvInfo while the request holds no KV
        req.kv.swa_evicted_seqlen = 17
    assert compat.swa_evicted_len(req) == 17
    if not ROW_ON_KV:
        released = SimpleNamespace(rid="b", req_pool_idx=None, kv=None)
        assert compat.slot_of(released) is None and compat.swa_evicted_len(released) is None
    with pytest.raises(compat.SglangLayoutError, match=r"req.kv.req_pool_idx \(sglang 0.5.23\) nor as "
                                                       r"req.req_pool_idx \(sglang 0.5.18\)"):
        compat.slot_of(SimpleNamespace(rid="c", kv=None))


def test_gathered_buffer_question_is_asked_the_installed_way():
    """sglang's own require_gathered_buffer answers (False: no attention DP, no MoE all-to-all), whether it takes
    the server arguments (0.5.18) or reads the runtime context (0.5.23)."""
    from sglang.srt.runtime_context import publish, reset_context
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(model_path="dummy")
    reset_context()
    publish(sa, role="test")
    try:
        assert compat.gathers_draft_inputs(sa) is False
    finally:
        reset_context()


def test_layer_boundary_owners_of_the_installed_sglang():
    """0.5.23's residual-stream entry points are all found (and wrapped by name); 0.5.18 has no such package."""
    from graphcap.sglang.loop import _EAGER_BOUNDARY_ENTRIES

    owners = compat.layer_boundary_owners(_EAGER_BOUNDARY_ENTRIES)
    has_package = VERSION != "0.5.18"
    assert len(owners) == (len(_EAGER_BOUNDARY_ENTRIES) if has_package else 0)
    if has_package:
        with pytest.raises(compat.SglangLayoutError, match=r"no sglang.srt.layers.layer_boundary.stage.StageBoundary"
                                                           r".nowhere"):
            compat.layer_boundary_owners([("sglang.srt.layers.layer_boundary.stage", "StageBoundary", "nowhere")])


# -----------------------------------------------------------------------------------------------------------------
# The window graphcap keeps == sglang's own update_sliding_window_buffer


class _Sim:
    """A scheduler in miniature over a page allocator: requests join (prefill), are retracted, get verified with
    random accepted counts, occasionally have in-window SWA pages remapped (eviction + reuse)."""

    def __init__(self, seed, rows, width, page, window, steps):
        self.rng = random.Random(seed)
        self.rows, self.width, self.page, self.window, self.steps = rows, width, page, window, steps
        self.pages = rows * (-(-width // page)) + 1
        self.r2t = torch.zeros(rows, width, dtype=torch.int32)
        g = torch.Generator().manual_seed(seed)
        pool = self.pages * page
        self.f2s = torch.cat([torch.zeros(1, dtype=torch.int64), 1 + torch.randperm(pool - 1, generator=g)])
        self.free_pages = list(range(1, self.pages))
        self.rng.shuffle(self.free_pages)
        self.running: dict[int, SimpleNamespace] = {}  # slot -> request
        self.next_rid = 0
        self.buffers = bind_window(self.r2t, window, self.f2s, max_accepted=steps + 1)
        self.tracker = SlotTracker(self.buffers)
        swa = SWAKVPool.__new__(SWAKVPool)  # only the mapping is read: no KV buffers needed
        swa.full_to_swa_index_mapping = self.f2s
        self.swa = swa

    def join(self):
        free = [s for s in range(self.rows) if s not in self.running]
        if not free:
            return
        slot = self.rng.choice(free)
        length = self.rng.randint(1, self.width - (self.steps + 1) * 4)
        n_pages = -(-self.width // self.page)
        pages = [self.free_pages.pop() for _ in range(n_pages)]
        locs = (torch.tensor(pages)[:, None] * self.page + torch.arange(self.page)).reshape(-1)[: self.width]
        self.r2t[slot] = locs.to(torch.int32)
        req = _req(f"r{self.next_rid}", slot, length=length, pages=pages)
        self.next_rid += 1
        self.running[slot] = req
        self.tracker.on_join([req])

    def retract(self):
        if len(self.running) > 1:
            slot = self.rng.choice(sorted(self.running))
            req = self.running.pop(slot)
            self.free_pages.extend(req.pages)
            self.tracker.on_retract([slot])

    def remap_window(self):
        """In-window SWA pages freed and re-assigned (what an eviction reaching into the window would mean)."""
        if not self.running:
            return
        slot = self.rng.choice(sorted(self.running))
        req = self.running[slot]
        lo = max(0, req.length - self.window)
        locs = self.r2t[slot, lo:req.length].long()
        self.f2s[locs] = self.f2s[locs].flip(0) + 7_000_000  # new SWA ids, distinct from all others
        self.tracker.on_evict(slot, evicted_upto=req.length, seq_len=req.length)

    def draft_and_compare(self):
        reqs = list(self.running.values())
        self.rng.shuffle(reqs)
        if not reqs:
            return None
        seq_lens = torch.tensor([r.length for r in reqs], dtype=torch.int64)
        slots, accepted, host = self.tracker.prepare(reqs, seq_lens)
        self.buffers.advance(slots, accepted)  # what graphcap's captured iteration does first
        indptr, ids = compat.sglang_window_indices(self.r2t, self.swa, slots, seq_lens, self.window, self.page)
        for i, req in enumerate(reqs):
            ours = self.buffers.window_locs(host[i]).long()
            theirs = ids[int(indptr[i]):int(indptr[i + 1])].long()
            assert torch.equal(ours, theirs), (req.rid, req.length, ours.tolist(), theirs.tolist())
        assert torch.equal(self.buffers.seq_lens.index_select(0, slots).long(), seq_lens)
        return reqs, slots

    def verify(self, reqs, slots):
        acc = [min(self.rng.randint(1, self.steps + 1), self.width - r.length) for r in reqs]
        for r, a in zip(reqs, acc):
            r.length += a
        self.tracker.on_accept(slots, torch.tensor(acc))


@pytest.mark.parametrize("page, window, seed, steps", [(1, 5, 0, 1), (4, 8, 1, 2), (16, 33, 2, 3), (64, 16, 3, 1),
                                                       (4, 1, 4, 3), (64, 64, 5, 2)])
def test_window_equals_sglang_update_sliding_window_buffer(page, window, seed, steps):
    """At 1, 2 and 3 draft steps (a verify accepts 1..steps + 1 tokens, the window buffers take up to steps + 1)."""
    sim = _Sim(seed, rows=6, width=128, page=page, window=window, steps=steps)
    compared = 0
    for it in range(40):
        r = sim.rng.random()
        if r < 0.25 or not sim.running:
            sim.join()
        elif r < 0.32:
            sim.retract()
        elif r < 0.38:
            sim.remap_window()
        step = sim.draft_and_compare()
        compared += 1 if step else 0
        if step:
            reqs, slots = step
            if any(rq.length + sim.steps + 1 > sim.width for rq in reqs):
                for rq in reqs:  # finished: leave, slot free for a new request
                    if rq.length + sim.steps + 1 > sim.width:
                        sim.running.pop(compat.slot_of(rq))
                        sim.free_pages.extend(rq.pages)
                continue
            sim.verify(reqs, slots)
    assert compared >= 30
    assert sim.tracker.stats["resets"] >= 2


def test_in_window_eviction_without_the_hook_would_diverge():
    """The reset on eviction is needed: remap the window's SWA ids without telling the tracker and the ring is stale."""
    sim = _Sim(7, rows=3, width=64, page=4, window=8, steps=2)
    sim.join()
    reqs, slots = sim.draft_and_compare()
    slot = compat.slot_of(reqs[0])
    locs = sim.r2t[slot, max(0, reqs[0].length - 8):reqs[0].length].long()
    sim.f2s[locs] += 9_000_000
    with pytest.raises(AssertionError):
        sim.draft_and_compare()


# -----------------------------------------------------------------------------------------------------------------
# Tree inputs of a chain == sglang's own bookkeeping


@pytest.mark.parametrize("steps", [1, 2, 3, 5])
def test_chain_tree_inputs_match_sglang(steps):
    from sglang.srt.speculative import spec_utils
    from sglang.srt.speculative.eagle_utils import organize_draft_results

    later = getattr(spec_utils._select_top_k_tokens_later, "_torchdynamo_orig_callable",
                    spec_utils._select_top_k_tokens_later)
    g = torch.Generator().manual_seed(steps)
    b, hidden = 4, 6
    h = torch.randn(b, hidden, generator=g)
    score_list, token_list, parents_list, chain = [], [], [], []
    scores = None
    for i in range(steps):
        probs = torch.softmax(torch.randn(b, 50, generator=g), -1)
        topk_p, topk_index = probs.max(-1, keepdim=True)
        chain.append(topk_index[:, 0])
        if i == 0:
            _, h, scores, info = spec_utils._select_top_k_tokens_first(topk_p, topk_index, h, 1)
        else:
            _, h, scores, info = later(i, topk_p, topk_index, h, scores, 1)
        score_list.append(info[0])
        token_list.append(info[1])
        parents_list.append(info[2])
    theirs = organize_draft_results(score_list, token_list, parents_list, steps + 1)
    ours = chain_tree_inputs(torch.stack(chain, 1).t().contiguous().t())  # a column-major view: still made dense
    for a, t in zip(ours, theirs):
        assert a.shape == t.shape and a.dtype == t.dtype and torch.equal(a, t)
        # sglang's tree kernel (jit/csrc/speculative/tree.cuh) checks every stride of a dimension of size > 1
        # against a dense row-major layout, as sglang's own tensors have it
        assert all(x == y for x, y, n in zip(a.stride(), t.contiguous().stride(), a.shape) if n > 1), \
            (a.stride(), a.shape)
        assert a.is_contiguous()


# -----------------------------------------------------------------------------------------------------------------
# The draft's tail: sglang's tree and verify input, with no host read of the device lengths


class _DeviceOnly(torch.Tensor):
    """A device tensor's stand-in on CPU: reading a value on the host (what is a device-to-host sync on a GPU)
    raises, and so does any tensor computed from it."""
    HOST_READS = {"item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in cls.HOST_READS:
            raise AssertionError(f"host read of the device lengths: Tensor.{func.__name__}")
        return super().__torch_function__(func, types, args, kwargs or {})


def _plain(t):
    return t.as_subclass(torch.Tensor) if isinstance(t, torch.Tensor) else t


def _tree_twin(*args):
    """sglang's tree kernel (it runs on the GPU, reading the lengths there), here the sgl_kernel stand-in's twin of
    sgl_kernel's op (tests/sglang/test_spec_tree_ops.py holds it to sglang's own Triton version), loaded without the
    stand-in package: this process runs sglang without an sgl_kernel."""
    from standin_ops import speculative

    build_tree_kernel_efficient_torch = speculative.build_tree_kernel_efficient_torch

    build_tree_kernel_efficient_torch(*[_plain(a) for a in args[:8]], *[int(a) for a in args[8:]])


def _read_cells(mask, mode, lens, n):
    """The cells the target verify reads: FULL_MASK rows of `seq_len + n` at the offsets sglang's Triton backend
    computes from the device lengths (mask_indptr = cumsum(n * (seq_len + n))); QLEN_ONLY n x n per request."""
    m = mask.view(torch.uint8)
    if mode.name == "QLEN_ONLY":
        return m[:len(lens) * n * n].clone()
    return torch.cat([m[o:o + n * (L + n)] for o, L in zip(
        [0] + torch.cumsum(torch.tensor([n * (L + n) for L in lens]), 0).tolist()[:-1], lens)])


_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu-check.sh runs these on one)")])


@pytest.mark.parametrize("case", ["gpu-only", "gpu-only-oversize", "host-lengths", "no-verify-mask"])
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("device", ["cpu", _CUDA])
def test_draft_tail_builds_sglangs_tree_without_reading_device_lengths(monkeypatch, case, steps, device):
    """graphcap's draft hands sglang's verify what sglang's own FROZEN_KV_MTP draft does - the tree from sglang's
    `build_tree_kernel_efficient` with the exact `seq_lens.sum().item()` - cell for cell where the verify reads,
    without reading `batch.seq_lens` on the host: written into the target backend's preallocated verify mask (sglang's
    own, as its EAGLE v2 worker does), else sized from the host's lengths or `bs * max_context_len`. On CPU the
    device lengths sit behind a guard that raises on a host read (and sglang's CUDA op is graphcap's twin); on a GPU
    sglang's own op runs under torch's sync debug mode, which raises on a synchronizing call."""
    from sglang.srt.layers.attention.verify_mask import maybe_create_verify_mask
    from sglang.srt.speculative import eagle_utils
    from sglang.srt.speculative.frozen_kv_mtp_info import FrozenKVMTPVerifyInput

    from graphcap.engine.iteration import DraftOutput

    # the name the installed eagle_utils calls its CUDA op by (0.5.23: a dispatcher; 0.5.18: sgl_kernel's, imported
    # on CUDA only)
    op = "build_tree_kernel_efficient_func" if hasattr(eagle_utils, "build_tree_kernel_efficient_func") else \
        "sgl_build_tree_kernel_efficient"
    if device == "cpu":
        monkeypatch.setattr(eagle_utils, op, _tree_twin, raising=False)
    g = torch.Generator().manual_seed(steps)
    n, max_bs, ctx = steps + 1, 4, 64
    bs = max_bs + 2 if case == "gpu-only-oversize" else 3
    lens = torch.randint(1, ctx - n, (bs,), generator=g).tolist()
    verify_mask = None if case == "no-verify-mask" else maybe_create_verify_mask(
        is_draft_runner=False, skip_prefill=False, max_bs=max_bs, max_context_len=ctx, num_draft_tokens=n,
        device=device, is_read=True, dtype=torch.uint8)
    # a backend without a verify mask may also lack sglang's max_context_len: the model's context length bounds it
    backend = SimpleNamespace(verify_mask=verify_mask) if case == "no-verify-mask" else \
        SimpleNamespace(verify_mask=verify_mask, max_context_len=ctx)
    runner = SimpleNamespace(attn_backend=backend, model_config=SimpleNamespace(context_len=ctx))
    worker = SimpleNamespace(speculative_num_steps=steps, speculative_num_draft_tokens=n,
                             target_worker=SimpleNamespace(model_runner=runner))
    rt = GraphcapDraftRuntime(worker, DraftCaptureOptions(enabled=True), _window_buffers(), target_pool=None)
    tokens = torch.randint(0, 1000, (bs, steps), generator=g).to(device)
    rt.graphs = object()  # captured (iterate is replaced below: the replay is tested elsewhere)
    monkeypatch.setattr(rt, "iterate", lambda batch: DraftOutput(tokens, None, None, None))
    host = case == "host-lengths"
    seq_lens = torch.tensor(lens, device=device)
    batch = SimpleNamespace(seq_lens=seq_lens.as_subclass(_DeviceOnly) if device == "cpu" else seq_lens,
                            seq_lens_sum=sum(lens) if host else None,
                            seq_lens_cpu=torch.tensor(lens) if host else None, return_hidden_states=True,
                            spec_info=SimpleNamespace(
                                bonus_tokens=torch.randint(0, 1000, (bs,), generator=g).to(device)))
    if device == "cuda":
        eagle_utils.build_tree_kernel_efficient(batch.spec_info.bonus_tokens, *chain_tree_inputs(tokens), seq_lens,
                                                sum(lens), 1, steps, n)  # sglang's op loaded (built) outside the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        ours = rt.draft(batch, fallback=lambda: pytest.fail("graphcap's draft fell back"))
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    assert isinstance(ours, FrozenKVMTPVerifyInput) and batch.return_hidden_states is False
    if case in ("gpu-only", "host-lengths"):  # the backend's own buffer, in place
        assert _plain(ours.custom_mask).data_ptr() == verify_mask.buffer.data_ptr()
    assert (ours.seq_lens_sum is None) == (not host) and (ours.seq_lens_cpu is None) == (not host)

    # stock sglang's tail (FrozenKVMTPDraftWorker.draft) on the same draft: the exact sum, a fresh mask
    parents, top, drafts = chain_tree_inputs(tokens)
    mode = verify_mask.mode if verify_mask is not None else eagle_utils.default_tree_mask_mode()
    stock = eagle_utils.build_tree_kernel_efficient(batch.spec_info.bonus_tokens, parents, top, drafts,
                                                    torch.tensor(lens, device=device), sum(lens), 1, steps, n, mode)
    names = ("custom_mask", "positions", "retrieve_index", "retrieve_next_token", "retrieve_next_sibling",
             "draft_token")
    for name, theirs in zip(names, stock):
        mine = _plain(getattr(ours, name))
        if name == "custom_mask":
            assert torch.equal(_read_cells(mine.cpu(), mode, lens, n), _read_cells(theirs.cpu(), mode, lens, n))
        else:
            assert torch.equal(mine, theirs), name
