"""lab/persistent_mlp.py's kernel computes the MLP: each phase alone (Triton's interpreter runs programs one after
another, so the grid-wide barrier is the GPU's to run) against float64, the down phase unsplit and split over K (its
arrival counts back at zero), from a first tile loaded before the wait the same bits as without, and the barrier's
form compiled for sm_90 (tests/sm90.py)."""
from __future__ import annotations

import pytest
import torch

from lab_scripts import LAB_DIR, load_lab_script
from sm90 import compile_for_sm90

pm = load_lab_script("persistent_mlp")


def test_phases_match_float64_and_the_first_tile_changes_no_bit(device):
    hidden, inter = 256, 512  # multiples of the kernel's tiles (no masks on K or N: the real shapes need none)
    g = torch.Generator().manual_seed(1)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16  # the interpreter's bf16 dot is not exact
    x = torch.randn(1, hidden, generator=g).to(device, dtype)
    w_gu = (torch.randn(2 * inter, hidden, generator=g) * hidden ** -0.5).to(device, dtype)
    w_d = (torch.randn(hidden, inter, generator=g) * inter ** -0.5).to(device, dtype)
    h = torch.empty(1, inter, device=device, dtype=dtype)
    part = torch.empty(4, hidden, device=device, dtype=torch.float32)
    counters = pm.new_counters(hidden, device)
    want = pm.reference(x, w_gu, w_d)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for programs in (3, 7):  # fewer programs than blocks: each takes several
        pm.launch(x, w_gu, w_d, h, h, counters, programs, 1)  # y unused by the first phase
        outs = {}
        for split, bk2, prefetch in ((1, 512, False), (1, 512, True), (2, 256, False), (4, 128, False),
                                     (4, 128, True)):
            y = torch.full((1, hidden), float("nan"), device=device, dtype=dtype)
            pm.launch(x, w_gu, w_d, h, y, counters, programs, 2, prefetch, split, part, bk2)
            assert float((y.double().cpu() - want.cpu()).norm() / want.norm()) < tol, (split, prefetch)
            outs[split, prefetch] = y
        assert torch.equal(outs[1, False], outs[1, True]) and torch.equal(outs[4, False], outs[4, True])
    assert counters.count_nonzero() == 0  # the barrier's untouched, each block's split count reset by its last


def test_bad_split_is_refused(device):
    x = torch.zeros(1, 256, device=device)
    with pytest.raises(ValueError, match="multiple of split x bk2"):
        pm.launch(x, x, torch.zeros(256, 512, device=device), x, x, pm.new_counters(256, device), 1, 2, split=3)


SM90 = f"""
import sys
sys.path.insert(0, {str(LAB_DIR)!r})
import persistent_mlp as pm
types = dict(x="*bf16", w_gu="*bf16", w_d="*bf16", h="*bf16", y="*bf16", counters="*i32")
types["part"] = "*fp32"
for prefetch, split, bk2 in ((False, 1, 512), (True, 1, 512), (False, 4, 512), (True, 8, 256)):
    consts = dict(PHASES=3, PREFETCH=prefetch, BN1=16, BK1=256, BN2=16, BK2=bk2, BM=16, S2=split)
    compile(pm._mlp_kernel, types, consts, 4, 4)
print("compiled")
"""


@pytest.mark.subprocess
def test_barrier_form_compiles_for_sm90(tmp_path):
    compile_for_sm90(SM90, tmp_path)
