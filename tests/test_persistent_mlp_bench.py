"""bench/persistent_mlp.py's kernel computes the MLP: each phase alone (Triton's interpreter runs programs one after
another, so the grid-wide barrier is the GPU's to run) against float64, the down phase from a first tile loaded
before the wait the same bits as without, and the barrier's form compiled for sm_90 (tests/sm90.py)."""
from __future__ import annotations

import torch

from bench_scripts import BENCH_DIR, load_bench_script
from sm90 import compile_for_sm90

pm = load_bench_script("persistent_mlp")


def test_phases_match_float64_and_the_first_tile_changes_no_bit(device):
    hidden, inter = 256, 512  # multiples of the kernel's tiles (no masks on K or N: the real shapes need none)
    g = torch.Generator().manual_seed(1)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16  # the interpreter's bf16 dot is not exact
    x = torch.randn(1, hidden, generator=g).to(device, dtype)
    w_gu = (torch.randn(2 * inter, hidden, generator=g) * hidden ** -0.5).to(device, dtype)
    w_d = (torch.randn(hidden, inter, generator=g) * inter ** -0.5).to(device, dtype)
    h = torch.empty(1, inter, device=device, dtype=dtype)
    y, y_first = (torch.empty(1, hidden, device=device, dtype=dtype) for _ in range(2))
    counters = torch.zeros(2, device=device, dtype=torch.int32)
    for programs in (3, 7):  # fewer programs than blocks: each takes several
        pm.launch(x, w_gu, w_d, h, y, counters, programs, 1)
        pm.launch(x, w_gu, w_d, h, y, counters, programs, 2)
        pm.launch(x, w_gu, w_d, h, y_first, counters, programs, 2, prefetch=True)
        want = pm.reference(x, w_gu, w_d)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert float((y.double().cpu() - want.cpu()).norm() / want.norm()) < tol
        assert torch.equal(y, y_first)
    assert counters.tolist() == [0, 0]  # touched only by the barrier's form


SM90 = f"""
import sys
sys.path.insert(0, {str(BENCH_DIR)!r})
import persistent_mlp as pm
types = dict(x="*bf16", w_gu="*bf16", w_d="*bf16", h="*bf16", y="*bf16", counters="*i32")
for prefetch in (False, True):
    compile(pm._mlp_kernel, types, dict(PHASES=3, PREFETCH=prefetch, BN1=16, BK1=256, BN2=16, BK2=512, BM=16), 4, 4)
print("compiled")
"""


def test_barrier_form_compiles_for_sm90(tmp_path):
    compile_for_sm90(SM90, tmp_path)
