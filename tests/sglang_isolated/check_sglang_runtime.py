"""Deep checks against the real sglang 0.5.23 runtime modules, run in a fresh interpreter by test_sglang_runtime.py
(they import sglang's scheduler, schedule batch, Triton backend and Frozen-KV MTP worker, with torchvision stubbed:
see _sglang_env.py). Run alone: `pytest -o python_files='check_*.py' tests/sglang_isolated`.

- the runtime hooks land on the real classes in a scheduler process, and without the flag nothing does;
- the hooked real methods still run sglang's own bodies and feed graphcap's bookkeeping (accepts, joins, evictions);
- the window graphcap keeps equals what sglang's own `update_sliding_window_buffer` (Triton backend) gathers, for
  random requests joining, being retracted, losing in-window SWA pages and advancing by random accepted counts;
- the chain's tree inputs equal sglang's own `select_top_k_tokens` + `organize_draft_results` for topk == 1.
"""
from __future__ import annotations

import os
import pkgutil
import random
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang", reason="the real sglang package is not installed")
pytestmark = pytest.mark.sglang

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _sglang_env import install_torchvision_stub  # noqa: E402

install_torchvision_stub()

import sglang.srt.managers.scheduler  # noqa: E402,F401  (a scheduler process has it imported)
from sglang.srt import plugins  # noqa: E402
from sglang.srt.layers.attention.triton_backend import update_sliding_window_buffer  # noqa: E402
from sglang.srt.managers.schedule_batch import ReqKvInfo, ScheduleBatch  # noqa: E402
from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator  # noqa: E402
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool  # noqa: E402
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402
from sglang.srt.speculative.frozen_kv_mtp_worker_v2 import FrozenKVMTPDraftWorker  # noqa: E402

from graphcap.integrations import sglang as plugin  # noqa: E402
from graphcap.integrations import sglang_hooks as hooks  # noqa: E402
from graphcap.integrations.sglang_runtime import (  # noqa: E402
    GraphcapDraftRuntime, SlotTracker, bind_window, chain_tree_inputs)


def _load_plugins(env: str | None) -> None:
    HookRegistry.reset()
    plugins._plugins_loaded = False
    plugin.STATE.runtime_hooks.clear()
    if env is None:
        os.environ.pop(plugin.ENV_VAR, None)
    else:
        os.environ[plugin.ENV_VAR] = env
    plugins.load_plugins()


def _raw(target: str):
    owner, attr = target.rsplit(".", 1)
    obj = pkgutil.resolve_name(owner)
    raw = obj.__dict__[attr]
    return getattr(raw, "__func__", raw)


# -----------------------------------------------------------------------------------------------------------------
# Hooks on the real classes (order matters: the first test runs before anything is patched)


def test_scheduler_process_without_the_flag_patches_nothing():
    _load_plugins(None)
    assert set(HookRegistry._hooks) == set(plugin.ARG_HOOKS)
    for target in plugin.RUNTIME_HOOKS:
        assert not hasattr(_raw(target), "__wrapped__"), target


def test_scheduler_process_with_the_flag_hooks_the_real_classes():
    _load_plugins(plugin.DraftCaptureOptions(enabled=True).to_json())
    for target in plugin.ARG_HOOKS + plugin.RUNTIME_HOOKS:
        assert target in HookRegistry._patched, f"sglang did not apply {target}"
        fn = _raw(target)
        assert hasattr(fn, "__wrapped__"), target
        assert fn.__wrapped__.__module__.startswith("sglang."), (target, fn.__wrapped__.__module__)
        assert fn.__wrapped__.__name__ == target.rsplit(".", 1)[1]


@pytest.fixture
def patched():
    """The flag's hooks applied once in this process (tests below may run alone, e.g. with -k)."""
    if not hasattr(_raw(plugin.BATCH_EVICT_SWA), "__wrapped__"):
        _load_plugins(plugin.DraftCaptureOptions(enabled=True).to_json())


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
    hooked = _raw(plugin.WORKER_DRAFT)
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
    reqs = [SimpleNamespace(rid="a", kv=SimpleNamespace(req_pool_idx=1))]
    worker = SimpleNamespace(_graphcap_runtime=_Runtime(tracker), _select_last_extend_hidden=lambda b, h: h,
                             _build_seed_draft_input=lambda tok, hid: "seed")
    batch = SimpleNamespace(forward_mode=ForwardMode.EXTEND, reqs=reqs)
    assert FrozenKVMTPDraftWorker._draft_extend_for_prefill(worker, batch, torch.zeros(1, 2), torch.zeros(1)) == "seed"
    assert tracker.owner == {3: "x"} and tracker.stats["joins"] == 1


def test_hooked_evict_swa_resets_only_when_the_window_is_touched(patched):
    tracker = SlotTracker(_window_buffers(window=8))
    rt = _Runtime(tracker)
    hooks._RUNTIMES.add(rt)
    try:
        kv = ReqKvInfo()
        kv.req_pool_idx = 2
        req = SimpleNamespace(rid="r", kv=kv)
        frontier = {"upto": 0}
        cache = SimpleNamespace(supports_swa=lambda: True,
                                evict_sliding_windows=lambda r, pre_len, eviction_interval=1:
                                r.kv.set_evicted_seqlen(ComponentType.SWA, frontier["upto"]))
        batch = SimpleNamespace(tree_cache=cache)
        frontier["upto"] = 40  # seq_len 50, W 8: window is [42, 50): untouched
        ScheduleBatch._evict_swa(batch, req, 49)
        assert tracker.stale == set()
        frontier["upto"] = 45  # into the window
        ScheduleBatch._evict_swa(batch, req, 49)
        assert tracker.stale == {2} and tracker.stats["evictions_in_window"] == 1
    finally:
        hooks._RUNTIMES.discard(rt)


def test_retract_hook_forgets_retracted_rows(patched):
    tracker = SlotTracker(_window_buffers())
    rt = _Runtime(tracker)
    hooks._RUNTIMES.add(rt)
    try:
        reqs = [SimpleNamespace(rid=r, kv=SimpleNamespace(req_pool_idx=s)) for r, s in (("a", 0), ("b", 3), ("c", 5))]
        tracker.owner.update({0: "a", 3: "b", 5: "c"})
        batch = SimpleNamespace(reqs=list(reqs))

        def retract(b):
            b.reqs = [reqs[0]]
            return [reqs[1], reqs[2]], 0.5, []

        assert hooks.around_retract_decode(retract, batch)[0] == [reqs[1], reqs[2]]
        assert tracker.owner == {0: "a"}
        assert hasattr(_raw(plugin.BATCH_RETRACT), "__wrapped__")  # and this hook is what sglang's method runs
    finally:
        hooks._RUNTIMES.discard(rt)


def test_for_worker_names_what_it_cannot_serve():
    class TritonAttnBackend:
        sliding_window_size = 8

    opts = plugin.DraftCaptureOptions(enabled=True)
    with pytest.raises(plugin.DraftCaptureConfigError, match=r"--speculative-eagle-topk must be 1, got 2"):
        GraphcapDraftRuntime.for_worker(SimpleNamespace(topk=2), opts)
    with pytest.raises(plugin.DraftCaptureConfigError, match=r"draft runs on FlashInferAttnBackend"):
        GraphcapDraftRuntime.for_worker(SimpleNamespace(topk=1, draft_attn_backend=type("FlashInferAttnBackend", (), {})()), opts)
    translating = SimpleNamespace(kv_index_translator=SimpleNamespace(is_translating=True))
    with pytest.raises(plugin.DraftCaptureConfigError, match=r"unified KV pool"):
        GraphcapDraftRuntime.for_worker(SimpleNamespace(topk=1, draft_attn_backend=TritonAttnBackend(),
                                                        draft_model_runner=translating), opts)


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
        self.translator = KVIndexTranslator(req_to_token=self.r2t, token_to_kv_pool_allocator=object(),
                                            token_to_kv_pool=swa, page_size=page, device="cpu")

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
        req = SimpleNamespace(rid=f"r{self.next_rid}", kv=SimpleNamespace(req_pool_idx=slot), length=length,
                              pages=pages)
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
        bs = len(reqs)
        indptr = torch.zeros(self.rows + 1, dtype=torch.int32)
        indptr, ids, lens, _ = update_sliding_window_buffer(indptr, self.translator, None, slots, self.window, seq_lens,
                                                            bs, "cpu", self.swa)
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


@pytest.mark.parametrize("page, window, seed", [(1, 5, 0), (4, 8, 1), (16, 33, 2), (64, 16, 3), (4, 1, 4)])
def test_window_equals_sglang_update_sliding_window_buffer(page, window, seed):
    sim = _Sim(seed, rows=6, width=128, page=page, window=window, steps=3)
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
                        sim.running.pop(rq.kv.req_pool_idx)
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
    slot = reqs[0].kv.req_pool_idx
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
