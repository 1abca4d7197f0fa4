"""WindowBuffers against a from-scratch rebuild (the invariant in docs/architecture.md, Window buffers), for the Triton kernels (interpreted on
CPU, native on CUDA) and for their torch twins."""
from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphcap.kernels import twins_on_cpu
from graphcap.kernels.window.update import window_advance, window_advance_torch
from graphcap.window import WindowBuffers, WindowError, check_slots
from tiers import examples

ROW = 48  # req_to_token row length in these tests
SLOTS = 6


def make_pools(seed: int, with_f2s: bool, device: str):
    g = torch.Generator().manual_seed(seed)
    pool = SLOTS * ROW + 1
    req_to_token = (1 + torch.randperm(pool - 1, generator=g)).reshape(SLOTS, ROW).to(torch.int32)
    f2s = torch.randint(1, 10_000, (pool,), generator=g) if with_f2s else None
    return req_to_token.to(device), (f2s.to(device) if f2s is not None else None)


def reference_window(wb: WindowBuffers, slot: int, length: int) -> torch.Tensor:
    locs = wb.req_to_token[slot, max(0, length - wb.window):length].cpu().long()
    if wb.full_to_swa is not None:
        locs = wb.full_to_swa.cpu()[locs]
    return locs


def check_invariant(wb: WindowBuffers, lens: dict[int, int]) -> None:
    for slot, length in lens.items():
        assert int(wb.seq_lens[slot]) == length
        assert torch.equal(wb.window_locs(slot).long(), reference_window(wb, slot, length)), f"slot {slot}"
    # Canonical layout: a fresh rebuild of the same lengths gives a bit-identical ring.
    fresh = WindowBuffers(wb.req_to_token, wb.window, wb.max_slots, wb.full_to_swa, wb.max_accepted)
    if lens:
        fresh.reset(list(lens), list(lens.values()))
    rows = list(lens)
    assert torch.equal(fresh.ring[rows], wb.ring[rows])
    assert torch.equal(fresh.seq_lens, wb.seq_lens)
    if rows:  # the check mode's comparison against a rebuild finds nothing either
        n, first = wb.mismatches(torch.tensor(rows + [wb.padding_slot], device=wb.device))
        assert n.tolist() == [0] * (len(rows) + 1) and first.tolist() == [-1] * (len(rows) + 1)


IMPLS = ["kernel", "twin"]


def impl_ctx(impl: str, device: str):
    return twins_on_cpu() if impl == "twin" and device == "cpu" else contextlib.nullcontext()


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), window=st.sampled_from([1, 2, 3, 5, 8, 16]), with_f2s=st.booleans(), seed=st.integers(0, 2**16))
def test_random_resets_and_advances_match_rebuild(impl, device, data, window, with_f2s, seed):
    if impl == "twin" and device == "cuda":
        pytest.skip("the twin is the CPU path")
    r2t, f2s = make_pools(seed, with_f2s, device)
    max_acc = data.draw(st.integers(1, 6), label="max_accepted")
    wb = WindowBuffers(r2t, window, SLOTS, f2s, max_accepted=max_acc)
    lens: dict[int, int] = {}
    with impl_ctx(impl, device):
        for _ in range(data.draw(st.integers(1, 12), label="ops")):
            if not lens or data.draw(st.integers(0, 3), label="op") == 0:
                slots = data.draw(st.lists(st.integers(0, SLOTS - 1), min_size=1, max_size=SLOTS, unique=True))
                new = [data.draw(st.integers(0, ROW - 8)) for _ in slots]
                wb.reset(slots, new, checked=data.draw(st.booleans(), label="checked"))
                lens.update(zip(slots, new))
            else:
                slots = data.draw(st.lists(st.sampled_from(sorted(lens)), min_size=1, max_size=len(lens), unique=True))
                acc = [data.draw(st.integers(0, min(max_acc, ROW - lens[s]))) for s in slots]
                pad = data.draw(st.integers(0, 3), label="padding rows")
                s_t = torch.tensor(slots + [wb.padding_slot] * pad, device=device)
                a_t = torch.tensor(acc + [0] * pad, device=device, dtype=torch.int32)
                wb.advance(s_t, a_t, checked=data.draw(st.booleans()))
                for s, a in zip(slots, acc):
                    lens[s] += a
            check_invariant(wb, lens)
    assert int(wb.seq_lens[wb.padding_slot]) == 0


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), window=st.sampled_from([1, 3, 8, 16]), with_f2s=st.booleans(), seed=st.integers(0, 2**16))
def test_mismatches_names_exactly_the_stale_positions(device, data, window, with_f2s, seed):
    """`mismatches` against a rebuild: after sglang changes a location graphcap holds (req_to_token rewritten at one
    position), that row counts it at that position if the window holds it, and nothing otherwise."""
    r2t, f2s = make_pools(seed, with_f2s, device)
    wb = WindowBuffers(r2t, window, SLOTS, f2s)
    slots = data.draw(st.lists(st.integers(0, SLOTS - 1), min_size=1, max_size=SLOTS, unique=True))
    lens = [data.draw(st.integers(1, ROW)) for _ in slots]
    wb.reset(slots, lens)
    i = data.draw(st.integers(0, len(slots) - 1), label="row")
    pos = data.draw(st.integers(0, lens[i] - 1), label="position")
    r2t[slots[i], pos] = r2t[slots[i], pos] % (SLOTS * ROW) + 1  # another location of the pool
    if f2s is not None and f2s[r2t[slots[i], pos]] == wb.ring[slots[i], pos % window]:
        f2s[r2t[slots[i], pos]] += 1  # its SWA id too
    n, first = wb.mismatches(torch.tensor(slots, device=device))
    inside = pos >= lens[i] - window
    want_n = [int(inside) if j == i else 0 for j in range(len(slots))]
    assert n.tolist() == want_n
    assert first.tolist() == [pos if (j == i and inside) else -1 for j in range(len(slots))]


def test_long_run_wraps_many_times(device):
    """Hundreds of advances wrap a W=7 ring dozens of times; every step still equals a rebuild."""
    g = torch.Generator().manual_seed(3)
    rows, width = 4, 400
    r2t = (1 + torch.randperm(rows * width, generator=g)).reshape(rows, width).to(torch.int32).to(device)
    f2s = torch.randint(1, 1 << 20, (rows * width + 1,), generator=g).to(device)
    wb = WindowBuffers(r2t, 7, rows, f2s, max_accepted=4)
    wb.reset([0, 1, 2, 3], [0, 1, 6, 7])
    lens = {0: 0, 1: 1, 2: 6, 3: 7}
    slots = torch.tensor([2, 0, 3, 1], device=device)
    for _ in range(90):
        acc = torch.randint(0, 5, (4,), generator=g)
        wb.advance(slots, acc.to(device))
        for s, a in zip(slots.tolist(), acc.tolist()):
            lens[s] += a
    assert max(lens.values()) > 10 * 7
    check_invariant(wb, lens)


def test_kernel_equals_twin_on_same_state(device):
    """The Triton advance and its torch twin leave identical buffers (CPU: kernel under the interpreter)."""
    if device == "cuda":
        pytest.skip("covered by the CPU run; on CUDA the property test checks the kernel against the rebuild")
    r2t, f2s = make_pools(11, True, device)
    wb = WindowBuffers(r2t, 5, SLOTS, f2s, max_accepted=4)
    wb.reset(range(SLOTS), [3, 0, 9, 17, 5, 1])
    g = torch.Generator().manual_seed(5)
    for _ in range(6):
        slots = torch.randperm(SLOTS, generator=g)[:4]
        acc = torch.randint(0, 5, (4,), generator=g)
        ring2, lens2 = wb.ring.clone(), wb.seq_lens.clone()
        window_advance_torch(ring2, lens2, r2t, f2s, slots, acc, 4)
        window_advance(wb.ring, wb.seq_lens, r2t, f2s, slots, acc, 4)
        assert torch.equal(ring2, wb.ring) and torch.equal(lens2, wb.seq_lens)


# ---------------------------------------------------------------------------------------------------------------
# Bad input: a clear error, and nothing half-updated.


@pytest.fixture
def wb(device):
    r2t, f2s = make_pools(1, True, device)
    wb = WindowBuffers(r2t, 4, SLOTS, f2s, max_accepted=3)
    wb.reset([0, 1, 2], [5, 10, ROW - 1])
    return wb


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda wb: wb.reset([0, SLOTS], [1, 1]), rf"reset: slot {SLOTS} out of range"),
        (lambda wb: wb.reset([-1], [1]), r"reset: slot -1 out of range"),
        (lambda wb: wb.reset([1, 3, 1], [1, 2, 3]), r"reset: slot 1 appears more than once"),
        (lambda wb: wb.reset([3], [ROW + 1]), rf"reset: seq_len {ROW + 1} for slot 3 is outside"),
        (lambda wb: wb.reset([3], [-2]), r"reset: seq_len -2 for slot 3"),
        (lambda wb: wb.reset([3, 4], [1]), r"reset: 2 slots but 1 seq_lens"),
        (lambda wb: wb.advance(_t(wb, [0, 7]), _t(wb, [1, 1]), checked=True), r"advance: slot 7 out of range"),
        (lambda wb: wb.advance(_t(wb, [0, 0]), _t(wb, [1, 1]), checked=True), r"advance: slot 0 appears more than once"),
        (lambda wb: wb.advance(_t(wb, [0, 1]), _t(wb, [1, -1]), checked=True), r"advance: accepted count -1 for slot 1"),
        (lambda wb: wb.advance(_t(wb, [2]), _t(wb, [2]), checked=True), rf"advance: slot 2 would reach length {ROW + 1}"),
        (lambda wb: wb.advance(_t(wb, [1]), _t(wb, [4]), checked=True), r"accepted count 4 for slot 1 exceeds max_accepted=3"),
        (lambda wb: wb.advance(_t(wb, [SLOTS]), _t(wb, [1]), checked=True), rf"padding slot {SLOTS} got accepted count 1"),
        (lambda wb: wb.reset([0], [1.5]), r"reset: seq_lens must be integers, got dtype torch.float32"),
        (lambda wb: wb.reset(torch.tensor([[0, 1]]), [1, 2]), r"reset: slots must be 1-D, got shape \(1, 2\)"),
        # advance's static checks run without checked=True (no sync needed): nothing is written on a bad call
        (lambda wb: wb.advance(_t(wb, [0]), _t(wb, [1]).float()),
         r"advance: accepted must be an integer tensor, got dtype torch.float32"),
        (lambda wb: wb.advance(_t(wb, [0, 1]), _t(wb, [1])), r"advance: slots \(2,\) and accepted \(1,\)"),
        (lambda wb: wb.advance([0], _t(wb, [1])), r"advance: slots must be a torch.Tensor, got list"),
    ],
)
def test_bad_input_is_rejected_and_changes_nothing(wb, call, match):
    ring, lens = wb.ring.clone(), wb.seq_lens.clone()
    with pytest.raises(WindowError, match=match):
        call(wb)
    assert torch.equal(ring, wb.ring) and torch.equal(lens, wb.seq_lens)


def test_check_slots_names_the_first_bad_slot_in_the_callers_error():
    """The one slot check behind reset/advance (WindowError) and DraftGraphs.run's host_slots (CaptureError)."""
    class Mine(Exception):
        pass

    check_slots([], 4, error=Mine, call="f")
    check_slots([3, 0, 4, 4, 1], 4, error=Mine, call="f", padding=4)  # the padding slot, any number of times
    with pytest.raises(Mine, match=r"^f: slot 9 out of range \[0, 4\) in xs$"):
        check_slots([9, 1, 1], 4, error=Mine, call="f", arg="xs")  # the first problem in order, not duplicates first
    with pytest.raises(Mine, match=r"^f: slot 1 appears more than once in slots$"):
        check_slots([1, 1, 9], 4, error=Mine, call="f")
    with pytest.raises(Mine, match=r"^f: slot 4 out of range \[0, 4\) in slots$"):
        check_slots([0, 4], 4, error=Mine, call="f")  # the padding slot only where allowed
    with pytest.raises(Mine, match=r"^f: slot -1 out of range \[0, 4\) \(or the padding slot 4\) in slots$"):
        check_slots([4, -1], 4, error=Mine, call="f", padding=4)


def test_corrupt_req_to_token_is_named(wb):
    wb.req_to_token[3, 2] = wb.full_to_swa.numel() + 5
    with pytest.raises(WindowError, match=r"slot 3: req_to_token\[3, 2\] = \d+ is not a location"):
        wb.reset([3], [4])
    wb.req_to_token[0, 5] = -3
    with pytest.raises(WindowError, match=r"slot 0: req_to_token\[0, 5\] = -3"):
        wb.advance(_t(wb, [0]), _t(wb, [1]), checked=True)


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_reset_names_the_first_bad_location_or_none(device, data):
    """Random corruptions of req_to_token inside and outside the windows: reset refuses iff one lies in a rebuilt
    window, naming the first such entry of the first such slot in call order (a plain loop over the host copy is the
    reference), and leaves the buffers untouched when it refuses."""
    r2t, f2s = make_pools(data.draw(st.integers(0, 99)), True, device)
    w = data.draw(st.integers(1, 12))
    wb = WindowBuffers(r2t, w, SLOTS, f2s, max_accepted=3)
    pool = f2s.numel()
    for _ in range(data.draw(st.integers(0, 4))):
        r, c = data.draw(st.integers(0, SLOTS - 1)), data.draw(st.integers(0, ROW - 1))
        wb.req_to_token[r, c] = data.draw(st.sampled_from([-7, -1, pool, pool + 123]))
    slots = data.draw(st.permutations(range(SLOTS)))[: data.draw(st.integers(1, SLOTS))]
    lens = [data.draw(st.integers(0, ROW)) for _ in slots]
    host = wb.req_to_token.cpu().tolist()
    expected = None
    for slot, n in zip(slots, lens):
        for p in range(max(0, n - w), n):
            if not 0 <= host[slot][p] < pool:
                expected = rf"reset: slot {slot}: req_to_token\[{slot}, {p}\] = {host[slot][p]} is not a location"
                break
        if expected:
            break
    ring, seq = wb.ring.clone(), wb.seq_lens.clone()
    if expected is None:
        wb.reset(slots, lens)
        assert wb.seq_lens[slots].tolist() == lens
    else:
        with pytest.raises(WindowError, match=expected):
            wb.reset(slots, lens)
        assert torch.equal(wb.ring, ring) and torch.equal(wb.seq_lens, seq)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(window=0), "window must be a positive int"),
        (dict(max_slots=SLOTS + 1), f"req_to_token has {SLOTS} rows, fewer than max_slots={SLOTS + 1}"),
        (dict(req_to_token=torch.zeros(SLOTS, ROW)), "req_to_token must be a 2-D int32/int64 tensor"),
        (dict(full_to_swa=torch.zeros(3, 3, dtype=torch.int64)), "full_to_swa must be a 1-D"),
        (dict(max_accepted=0), "max_accepted must be a positive int"),
    ],
)
def test_bad_construction(kwargs, match):
    args = dict(req_to_token=torch.zeros(SLOTS, ROW, dtype=torch.int32), window=4, max_slots=SLOTS)
    args.update(kwargs)
    with pytest.raises(WindowError, match=match):
        WindowBuffers(**args)


def _t(wb: WindowBuffers, xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, device=wb.device)


@pytest.mark.gpu
def test_reset_syncs_once_however_many_rows():
    """reset validates from one read-back: one device-to-host sync for 1 row or all of them (CUDA's sync debug
    mode counts them)."""
    from graphcap.bench.counting import count_syncs

    r2t, f2s = make_pools(3, True, "cuda")
    wb = WindowBuffers(r2t, 8, SLOTS, f2s, max_accepted=3)
    for slots in ([2], list(range(SLOTS))):
        lens = torch.randint(0, ROW + 1, (len(slots),), device="cuda")
        torch.cuda.synchronize()
        assert count_syncs(lambda: wb.reset(slots, lens), cuda=True).value == 1


@pytest.mark.gpu
def test_an_unchecked_reset_does_not_sync():
    """reset(checked=False) (the sglang plugin's rebuild outside its check mode) reads nothing back: no
    device-to-host sync for 1 row or all of them, the lengths on the device."""
    from graphcap.bench.counting import count_syncs

    r2t, f2s = make_pools(3, True, "cuda")
    wb = WindowBuffers(r2t, 8, SLOTS, f2s, max_accepted=3)
    for slots in ([2], list(range(SLOTS))):
        lens = torch.randint(0, ROW + 1, (len(slots),), device="cuda")
        torch.cuda.synchronize()
        assert count_syncs(lambda: wb.reset(slots, lens, checked=False), cuda=True).value == 0


def test_an_unchecked_reset_checks_host_slots_and_clamps_lengths(device):
    """Without the read-back, slots given as host ints are still refused by name, a refused call writes nothing, and
    a length past the row gives what the row's own length gives (nothing is read outside req_to_token)."""
    r2t, f2s = make_pools(5, True, device)
    wb = WindowBuffers(r2t, 8, SLOTS, f2s, max_accepted=3)
    wb.reset([1, 2], [5, 9])
    before = (wb.ring.clone(), wb.seq_lens.clone())
    for bad, msg in (([1, 1], r"reset: slot 1 appears more than once"), ([SLOTS], rf"reset: slot {SLOTS} out of"),
                     (torch.tensor([-1]), r"reset: slot -1 out of range")):
        with pytest.raises(WindowError, match=msg):
            wb.reset(bad, [3] * len(bad), checked=False)
        assert torch.equal(wb.ring, before[0]) and torch.equal(wb.seq_lens, before[1])
    ref = WindowBuffers(r2t, 8, SLOTS, f2s, max_accepted=3)
    ref.reset([1, 2, 4], [5, 9, ROW])
    wb.reset([4], torch.tensor([ROW + 7], device=device), checked=False)
    assert torch.equal(wb.ring, ref.ring) and torch.equal(wb.seq_lens, ref.seq_lens)


@settings(max_examples=examples(200), deadline=None)
@given(slots=st.lists(st.integers(-3, 9), max_size=12), padding=st.sampled_from([None, 6]))
def test_check_slots_fast_path_agrees_with_a_plain_loop(slots, padding):
    """check_slots' few-C-calls fast path and its slow path against a plain loop: raises exactly when a slot (the
    padding slot aside) is out of [0, 6) or repeated, naming the first such slot in order."""
    bad, seen = None, set()
    for s in slots:
        if padding is not None and s == padding:
            continue
        if not 0 <= s < 6 or s in seen:
            bad = s
            break
        seen.add(s)
    if bad is None:
        check_slots(slots, 6, error=WindowError, call="t", padding=padding)
    else:
        with pytest.raises(WindowError, match=rf"^t: slot {bad} "):
            check_slots(slots, 6, error=WindowError, call="t", padding=padding)
