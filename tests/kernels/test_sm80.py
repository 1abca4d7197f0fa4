"""graphcap's kernels on an A100 (sm_80), checked on a CPU: every Triton kernel compiled for sm_80 with Triton's
bundled ptxas at the configurations the planners choose for an A100 (within its 163 KiB of shared memory per block,
no register spill beyond the bounds named below), the same kernels as an H200 compiles them under
GRAPHCAP_KERNEL_PATHS=sm80 (lowered for 80: no wgmma), and the planners' choices for an sm_80 description and under
the switch (graphcap.kernels.arch)."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcap.envvars import FORCED_KERNEL_PATHS, KERNEL_PATHS_ENV
import graphcap.kernels.gemm.skinny as sg
from graphcap.kernels import arch
from graphcap.kernels.arch import SM80, SM90, GpuArch
from graphcap.kernels.attention.plan import default_config, plan_attention, program_smem, target_programs
from sm90 import SM80 as TARGET_SM80
from sm90 import SM80_ON_SM90, SM90 as TARGET_SM90, Target, compile_for
from tiers import examples
from test_spec_tree_ops import FAST_TOPK_SCRIPT, SPEC_TREE_OPS_SCRIPT

ROOT = Path(__file__).resolve().parents[2]
# where Triton kernels live: graphcap's, and the sgl_kernel stand-in's own (tests/support/sgl_kernel)
KERNEL_DIRS = (ROOT / "graphcap" / "kernels", ROOT / "tests" / "support" / "sgl_kernel")

# ---------------------------------------------------------------------------------------------------------------
# Compile scripts, one per file of KERNEL_DIRS that holds Triton kernels (KERNEL_SCRIPTS, keyed by its path in the
# repo). Each runs after tests/sm90.py's prelude (compile(), CAPABILITY, ARCH, PLAN_ARCH: the description the planners
# plan for) and COMMON, compiles its kernels as the planners and launches choose them at the Gemma 4 draft's shapes
# (THOROUGH: every variant, dtype and candidate as well) and prints "compiled <count>". A new kernel file adds one
# here.

COMMON = """
import torch
from graphcap.kernels import arch
DESC = getattr(arch, PLAN_ARCH)
DTYPES = ("bf16", "fp16", "fp32") if THOROUGH else ("bf16",)
n = 0
"""

ATTENTION = """
from graphcap.kernels.attention import decode_kernels as A
from graphcap.kernels.attention.plan import plan_attention, query_block

TORCH = dict(bf16=torch.bfloat16, fp16=torch.float16, fp32=torch.float32)
seen = set()
for heads, kv_heads, d, max_len in ((32, 16, 256, 1024), (32, 4, 512, 32768)):  # sliding (W) and full layers
    group = heads // kv_heads
    block_g = query_block(group, d)
    for dt in DTYPES:
        types = dict(q="*" + dt, k_pool="*" + dt, v_pool="*" + dt, table="*i32", slots="*i64", lens="*i32",
                     out="*" + dt, part="*fp32", lse="*fp32", q_w="*" + dt, cos="*fp32", sin="*fp32",
                     sm_scale_log2="fp32", eps="fp32")
        # every bucket's plan, and the plan for any batch (one compile for every bucket)
        for b in (None, 1, 2, 4, 8, 16, 32, 64):
            p = plan_attention(b, kv_heads, d, TORCH[dt], "cuda", max_len, arch=DESC)
            single = p.num_splits == 1
            for norm_rope in (True, False) if THOROUGH else (True,):
                for wave_in_kernel in (True, False) if THOROUGH else (True,):
                    key = (d, dt, p.block_n, p.num_warps, p.num_stages, single, norm_rope, wave_in_kernel)
                    if key in seen:
                        continue
                    seen.add(key)
                    consts = dict(H=heads, GROUP=group, HEAD_TILES=-(-group // block_g), D=d, BLOCK_D=d,
                                  BLOCK_G=block_g, BLOCK_N=p.block_n, SINGLE=single, F32_DOT=dt == "fp32",
                                  WAVE_IN_KERNEL=wave_in_kernel, NORM_ROPE=norm_rope)
                    # the full layer's [16, 512] fp32 accumulator spills a little, on sm_90 too: 20-96 bytes with
                    # Triton 3.9's ptxas, 144-160 with Triton 3.6's; fp32 tiles at these widths (kilobytes of
                    # spill) are no shape graphcap runs
                    compile(A._split_kernel, types, consts, p.num_warps, p.num_stages,
                            max_spill=None if dt == "fp32" else 192 if d == 512 else 0)
                    n += 1
print("compiled", n)
"""

ONLINE_SOFTMAX = """
from graphcap.kernels.attention import online_softmax as O
from graphcap.kernels.attention.plan import plan_attention

# the combine kernel at every split bound the decode plans launch it with (its tile step is compiled inside the
# decode and verify kernels)
TORCH = dict(bf16=torch.bfloat16, fp16=torch.float16, fp32=torch.float32)
seen = set()
for heads, kv_heads, d, max_len in ((32, 16, 256, 1024), (32, 4, 512, 32768)):  # sliding (W) and full layers
    for dt in DTYPES:
        for b in (None, 1, 2, 4, 8, 16, 32, 64):
            p = plan_attention(b, kv_heads, d, TORCH[dt], "cuda", max_len, arch=DESC)
            block_s = triton.next_power_of_2(p.num_splits)
            if p.num_splits > 1 and (d, dt, block_s, p.combine_warps) not in seen:
                seen.add((d, dt, block_s, p.combine_warps))
                compile(O.combine_kernel, dict(part="*fp32", lse="*fp32", out="*" + dt),
                        dict(H=heads, D=d, BLOCK_D=d, BLOCK_S=block_s), p.combine_warps, max_spill=0)
                n += 1
print("compiled", n)
"""

SKINNY_GEMM = """
import graphcap.kernels.gemm.skinny as sg
import graphcap.kernels.gemm.skinny_kernels as sgk

ARGS = ["x", "w", "y", "out", "counters", "M", "N", "K", "k_split", "stride_xm", "stride_wn", "stride_ym",
        "stride_ys", "stride_om"]
ALIGNED = {(j,): [["tt.divisibility", 16]] for j in (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)}  # as a launch's tensors give
SHAPES = ((8192, 1536, False), (1536, 8192, False), (6144, 1536, True))  # wide (q_proj), narrow (o_proj), gate/up
configs = set()
for m in range(1, 65):
    for n_out, k, gated in SHAPES:
        planned = sg.plan(m, n_out, k, gated, DESC)
        assert planned == sg.candidates(m, n_out, k, gated)[0], (m, planned)  # the H200's choice fits an A100
        configs.add((planned, m if planned.gemv else max(16, triton.next_power_of_2(m)), gated))
planned_configs = set(configs)
if THOROUGH:  # every candidate of every class
    for key, cfgs in sg.CANDIDATES.items():
        for m in {"m1": (1,), "m4": (1, 4), "m16": (16,), "m64": (32, 64)}[key.split("-")[0]]:
            configs |= {(c, m if c.gemv or not c.dot else max(16, triton.next_power_of_2(m)), "gated" in key)
                        for c in cfgs}
seen = set()
for cfg, bm, gated in sorted(configs):
    for even in (True, False) if THOROUGH else (True,):
        if cfg.gemv:
            if (cfg, gated, even) in seen:
                continue
            seen.add((cfg, gated, even))
            consts = dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GATED=gated, INTERPRET=False, EVEN_K=even,
                          EVEN_N=even, STAGES=cfg.num_stages)
            k = compile(sgk.gemv_kernel, dict(x="*bf16", w="*bf16", out="*bf16"), consts, cfg.num_warps,
                        attrs={(j,): [["tt.divisibility", 16]] for j in (0, 1, 2, 5, 6, 7, 8)},
                        max_spill=0 if even else None)
            assert cfg.num_stages == 1 or "cp.async" in k.asm["ptx"], cfg  # the loads pipelined
            n += 1
            continue
        fixup = cfg.fixup and cfg.split_k > 1
        types = dict(x="*bf16", w="*bf16", out="*bf16", y="*fp32" if fixup else "*bf16",
                     counters="*i32" if fixup else "*bf16")
        consts = dict(BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GATED=gated, DOT=cfg.dot, INTERPRET=False,
                      EVEN_K=even, EVEN_N=even, FIXUP=fixup, SPLITS=cfg.split_k if fixup else 1)
        # masked tiles (no draft shape has them) may spill a few bytes, and so may a candidate no plan picks
        # (Triton 3.6's ptxas: 16 bytes at BLOCK_K 256 under the switch)
        k = compile(sgk.skinny_kernel, types, consts, cfg.num_warps, cfg.num_stages, ALIGNED,
                    max_spill=None if not even else 0 if (cfg, bm, gated) in planned_configs else 32)
        ptx = k.asm["ptx"]
        if cfg.dot:
            # Hopper's MMA exactly where Triton lowers for 90 and a warp group's 64 rows fit the weight rows (else
            # mma.sync); Triton's shared memory as pipeline_smem counts it
            lowered = int(ARCH[2:]) if ARCH else CAPABILITY
            wgmma = lowered >= 90 and cfg.block_n >= 64
            assert ("wgmma" in ptx) == wgmma and ("mma.sync" in ptx) != wgmma, (cfg, lowered)
            smem = sg.pipeline_smem(cfg, bm, gated, arch=DESC)
            assert k.metadata.shared == smem or cfg.num_stages == 1 and k.metadata.shared < smem, \\
                (cfg, bm, gated, k.metadata.shared, smem)
        n += 1
compile(sgk.splitk_sum_kernel, dict(ws="*fp32", out="*bf16"), dict(BLOCK=1024, INTERPRET=False), 4, max_spill=0)
print("compiled", n + 1)
"""

CENTROID_HEAD = """
from graphcap.kernels.head import centroid as C

for dt in DTYPES:
    for k, t, h in ((32, 128, 1536),) + (((4, 4, 32), (32, 128, 5376)) if THOROUGH else ()):  # top 32 of 2048 x 128
        consts = dict(K=k, T=t, H=h, BLOCK_T=min(C.BLOCK_T, triton.next_power_of_2(t)),
                      BLOCK_H=min(C.BLOCK_H, max(16, triton.next_power_of_2(h))))
        compile(C._centroid_logits_kernel, dict(lm_head="*" + dt, x="*" + dt, top="*i64", out="*fp32"), consts,
                C.NUM_WARPS, max_spill=0)
        n += 1
print("compiled", n)
"""

SMALL_TOPK = """
from graphcap.kernels.head import small_topk as S

for dt in DTYPES:
    for rows, k in ((2048, 32), (4096, 2)) + (((2048, 33), (8192, S.MAX_K), (16, 1)) if THOROUGH else ()):
        block = max(16, triton.next_power_of_2(rows))
        consts = dict(N=rows, K=k, BLOCK_N=block, BLOCK_K=max(2, triton.next_power_of_2(k)))
        compile(S._small_topk_kernel, dict(x="*" + dt, values="*" + dt, indices="*i64"), consts,
                S.warps_for(block), max_spill=0)
        n += 1
print("compiled", n)
"""

CANDIDATE_PICK = """
from graphcap.kernels.head import candidate_pick as P

for dt in DTYPES:
    for rows, t in ((4096, 128),) + (((P.MAX_N, 128), (16, 4)) if THOROUGH else ()):  # 32 clusters x 128 tokens
        block = max(16, triton.next_power_of_2(rows))
        compile(P._candidate_greedy_kernel, dict(values="*" + dt, top="*i64", token_ordering="*i64", token="*i64",
                                                 logit="*fp32"),
                dict(N=rows, T=t, BLOCK_N=block), P.warps_for(block), max_spill=0)
        n += 1
print("compiled", n)
"""

FUSED_OPS = """
from graphcap.kernels.elementwise import fused_ops as F

for dt in DTYPES:
    types = dict(x="*" + dt, res="*" + dt, out="*" + dt, w="*" + dt, eps="fp32", q="*" + dt, k="*" + dt,
                 cache="*fp32", pos="*i64")
    for width in (1536, 5376):  # the draft's and the target's hidden rows
        block = triton.next_power_of_2(width)
        for add in (True, False):
            for offset in (1.0, 0.0) if THOROUGH else (1.0,):
                compile(F._rmsnorm_kernel, types, dict(W_OFFSET=offset, ADD=add, BLOCK=block),
                        min(16, max(1, block // 256)), max_spill=0)
                n += 1
    for act in F.ACTS.values() if THOROUGH else (F.ACTS["gelu_tanh"],):  # the draft's MLP: I = 6144
        compile(F._act_mul_kernel, types, dict(ACT=act, BLOCK=1024), 4, max_spill=0)
        n += 1
    for half in (128, 256):  # rotary over heads of 256 and 512
        for neox in (True, False) if THOROUGH else (True,):
            compile(F._rope_kernel, types, dict(NEOX=neox, BLOCK=half), 4, max_spill=0)
            n += 1
print("compiled", n)
"""

LAYER_FUSIONS = """
from graphcap.kernels.elementwise import layer_fusions as L

for dt in DTYPES + (() if THOROUGH else ("fp32",)):  # the draft's rows; fp32 as the tiny spec runs
    types = {name: "*" + dt for name in ("x", "res", "w_x", "w_sum", "w_out", "scalar", "normed", "total", "out",
                                         "q", "w")}
    types.update(eps="fp32", cos="*fp32", sin="*fp32", slots="*i64", lens="*i32")
    block = triton.next_power_of_2(1536)
    for fn in (L._norm_add_norm_kernel, L._norm_add_scale_norm_kernel):
        compile(fn, types, dict(BLOCK=block), L.warps_for(block), max_spill=0)
        n += 1
    for half in (128, 256):  # query heads of 256 and 512
        compile(L._norm_rope_kernel, types, dict(BLOCK=half), L.warps_for(half), max_spill=0)
        n += 1
print("compiled", n)
"""

WINDOW_UPDATE = """
from graphcap.kernels.window import update as W

for ring in ("i32", "i64") if THOROUGH else ("i32",):
    types = dict(ring="*" + ring, seq_lens="*i32", req_to_token="*i32", full_to_swa="*i64", slots="*i64",
                 accepted="*i64", new_lens="*i64")
    for f2s in (True, False):
        for block in (2, 4, 8) if THOROUGH else (4,):  # min(accepted tokens, W): steps + 1
            compile(W._window_advance_kernel, types, dict(HAS_F2S=f2s, BLOCK=block), 4, max_spill=0)
            n += 1
        compile(W._window_reset_kernel, types, dict(HAS_F2S=f2s, BLOCK=1024), 4, max_spill=0)  # W = 1024
        n += 1
print("compiled", n)
"""

VERIFY_ATTENTION = """
from graphcap.kernels.attention import verify as V

TORCH = dict(bf16=torch.bfloat16, fp16=torch.float16, fp32=torch.float32)
seen = set()
for heads, kv_heads, d, max_len in ((32, 16, 256, 1023), (32, 4, 512, 8192)):  # the target's sliding and full layers
    for dt in DTYPES:
        types = dict(q="*" + dt, k_new="*" + dt, v_new="*" + dt, k_pool="*" + dt, v_pool="*" + dt, indptr="*i32",
                     indices="*i64", out="*" + dt, part="*fp32", lse="*fp32", sm_scale_log2="fp32")
        for n_q in (2, 3, 4) if THOROUGH else (4,):
            for b in (1, 8, 32):
                p = V.plan_verify(b, kv_heads, heads, d, n_q, TORCH[dt], "cuda", max_len, arch=DESC)
                ap = p.attention
                key = (d, dt, n_q, p.heads, p.block_m, ap.block_n, ap.num_warps, ap.num_stages, ap.num_splits == 1)
                if key in seen:
                    continue
                seen.add(key)
                consts = dict(H=heads, GROUP=heads // kv_heads, HEADS=p.heads, HEAD_TILES=p.head_tiles, NQ=n_q, D=d,
                              BLOCK_D=d, BLOCK_M=p.block_m, BLOCK_N=ap.block_n, BLOCK_E=16,
                              SINGLE=ap.num_splits == 1, F32_DOT=dt == "fp32")
                # Spills, bounded at what ptxas gave: the full layer's q, accumulator and K/V tiles at [16, 512] -
                # at 4 warps on sm_90a 668 bytes with Triton 3.9's ptxas, 760 with 3.6's (the configuration measured
                # on the H200: faster than the decode kernel all the same; 8 warps is untimed there), <= 128 at
                # sm_80's 8 warps and 16-key tiles;
                # at D = 256 on sm_90a and under the switch 32-48 bytes with Triton 3.9's ptxas, 112 with 3.6's
                compile(V._verify_split_kernel, types, consts, ap.num_warps, ap.num_stages,
                        max_spill=None if dt == "fp32" else (768 if ap.num_warps == 4 else 128) if d == 512 else 128)
                n += 1
print("compiled", n)
"""

PDL_START = """
from graphcap.kernels import arch, pdl
from graphcap.kernels.head import small_topk as S

# pdl_start inside a kernel, both ways where the target has PDL (the prelude's compile checks griddepcontrol is in
# the PTX exactly with GDC), plain launches only where it has not: the planners' description agrees
assert DESC.hopper == PDL or ARCH, (DESC, PDL)
for gdc in (False, True) if PDL else (False,):
    compile(S._small_topk_kernel, dict(x="*bf16", values="*bf16", indices="*i64"),
            dict(N=4096, K=32, BLOCK_N=4096, BLOCK_K=32, GDC=gdc), 4, max_spill=0)
    n += 1
print("compiled", n)
"""

KERNEL_SCRIPTS = {f"graphcap/kernels/{name}": script for name, script in (
    ("attention/decode_kernels.py", ATTENTION), ("attention/online_softmax.py", ONLINE_SOFTMAX),
    ("attention/verify.py", VERIFY_ATTENTION),
    ("gemm/skinny_kernels.py", SKINNY_GEMM), ("head/centroid.py", CENTROID_HEAD), ("head/small_topk.py", SMALL_TOPK),
    ("head/candidate_pick.py", CANDIDATE_PICK), ("elementwise/fused_ops.py", FUSED_OPS),
    ("elementwise/layer_fusions.py", LAYER_FUSIONS), ("window/update.py", WINDOW_UPDATE), ("pdl.py", PDL_START),
)} | {  # shared with test_spec_tree_ops.py
    "tests/support/sgl_kernel/top_k.py": FAST_TOPK_SCRIPT,
    "tests/support/sgl_kernel/speculative.py": SPEC_TREE_OPS_SCRIPT,
}
# kernel files being written as this test was: their owners add their scripts here and take them off this list
PENDING: set[str] = set()
# kernel files whose own tests compile their plans for sm_80 and sm_90 without spills, at the shapes they plan for
COMPILED_BY_OWN_TESTS = {"tests/support/sgl_kernel/int8_gemm.py": "tests/sglang/test_int8_gemm.py"}


# Runs the scripts in one process (starting Python with torch and Triton costs more than most scripts' compiles),
# each in a namespace of its own; a failing script is named with its traceback and the others still run.
DRIVER = """
import sys
import traceback

failed = []
for name, src in PARTS:
    space = dict(globals())
    try:
        exec(COMMON + src, space)
    except Exception:
        failed.append(name)
        print(f"--- {name} for {TARGET_NAME}:", traceback.format_exc(), file=sys.stderr)
FAILED_PARTS = failed  # the epilogue (tests/sm90.py) exits naming them, and every spill past its bound
print("compiled all")
"""


def compile_scripts(names: list[str], target: Target, thorough: bool, tmp_path: Path) -> str:
    """The named scripts compiled for `target` (one subprocess); returns its output."""
    head = f"THOROUGH = {thorough}\nCOMMON = {COMMON!r}\nPARTS = {[(n, KERNEL_SCRIPTS[n]) for n in names]!r}\n"
    out = compile_for(head + DRIVER, tmp_path, target)
    print("\n".join(line for line in out.splitlines() if line.startswith("spilled")))  # shown by pytest -rP
    counts = dict(zip(names, map(int, re.findall(r"^compiled (\d+)$", out, re.M))))
    assert len(counts) == len(names) and all(counts.values()), out[-2000:]
    return out


def test_every_kernel_file_has_a_compile_script():
    with_kernels = {p.relative_to(ROOT).as_posix() for d in KERNEL_DIRS for p in d.rglob("*.py")
                    if "@triton.jit" in p.read_text()}
    missing = with_kernels - set(KERNEL_SCRIPTS) - PENDING - set(COMPILED_BY_OWN_TESTS)
    assert not missing, f"add a compile script to tests/kernels/test_sm80.py KERNEL_SCRIPTS for {sorted(missing)}"
    for path, test in COMPILED_BY_OWN_TESTS.items():
        assert path in with_kernels and "test_plans_compile_for_the_gpus" in (ROOT / test).read_text(), path
    assert set(KERNEL_SCRIPTS) <= with_kernels


def test_kernels_compile_for_sm80(tmp_path):
    """Every kernel file's kernels at the configurations an A100's plans launch, compiled for sm_80."""
    compile_scripts(sorted(KERNEL_SCRIPTS), TARGET_SM80, False, tmp_path)


def test_draft_kernels_take_pdl_on_sm90(tmp_path):
    """The draft's kernels that take programmatic dependent launch, compiled as an H100/H200 launches them (GDC on:
    griddepcontrol in the PTX, checked by the prelude's compile), and the switch's sm_80 lowering without it."""
    draft = ["attention/decode_kernels.py", "attention/online_softmax.py", "head/candidate_pick.py", "pdl.py"]
    compile_scripts([f"graphcap/kernels/{name}" for name in draft], TARGET_SM90, False, tmp_path)
    compile_scripts(["graphcap/kernels/pdl.py"], SM80_ON_SM90, False, tmp_path)


def test_switch_lowers_for_sm80_on_sm90(tmp_path):
    """An H200 under GRAPHCAP_KERNEL_PATHS=sm80 (Triton lowering for 80, ptxas for sm_90a): the skinny GEMM - the
    kernels with a tl.dot that sm_90 makes a wgmma - uses mma.sync, with an A100's plans and shared memory."""
    compile_scripts(["graphcap/kernels/gemm/skinny_kernels.py"], SM80_ON_SM90, False, tmp_path)


@pytest.mark.thorough
@pytest.mark.parametrize("target", [TARGET_SM80, SM80_ON_SM90, TARGET_SM90], ids=lambda t: t.name)
def test_every_variant_compiles(target, tmp_path):
    """Every kernel variant, dtype and skinny GEMM candidate for sm_80, under the switch, and for sm_90 (the
    kernels without an sm_90 compile test of their own included): minutes per target."""
    compile_scripts(sorted(KERNEL_SCRIPTS), target, True, tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# planners on an sm_80 description

SLIDING, FULL = (16, 256, 1024), (4, 512, 32768)  # kv heads, head dim, longest row
BATCHES = (None, 1, 2, 3, 4, 8, 16, 32, 64)
FLOATS = (torch.bfloat16, torch.float16, torch.float32)


@pytest.mark.parametrize("dtype", FLOATS)
def test_attention_plans_fit_an_a100(dtype):
    """Every bucket's plan for an A100 asks for no more shared memory per block or SM than it has, and is what
    the H200's rule gives with the A100's numbers: its 108 SMs, and at head dim 512 two stages where the H200 takes
    three (three of bf16 K and V tiles would need 200 KiB)."""
    for (kv, d, max_len), b in ((s, b) for s in (SLIDING, FULL) for b in BATCHES):
        p = plan_attention(b, kv, d, dtype, "cuda", max_len, arch=SM80)
        cfg = default_config(d, dtype, True, SM80.smem_per_block)
        assert (p.block_n, p.num_warps, p.num_stages, p.min_chunk) == (cfg.block_n, cfg.num_warps, cfg.num_stages,
                                                                        cfg.min_chunk)
        assert program_smem(cfg, d, dtype.itemsize) <= SM80.smem_per_block
        per_sm = SM80.smem_per_sm // program_smem(cfg, d, dtype.itemsize)
        assert per_sm >= 1 and p.programs == 2 * min(per_sm, 2048 // (32 * cfg.num_warps)) * 108
    assert plan_attention(1, 4, 512, torch.bfloat16, "cuda", 32768, arch=SM80).num_stages == 2
    assert plan_attention(1, 4, 512, torch.bfloat16, "cuda", 32768, arch=SM90).num_stages == 3
    assert target_programs(256, torch.bfloat16, torch.device("cuda"), SM90) == 528  # the H200's, unchanged


def test_skinny_plans_fit_an_a100():
    """Every row count and shape class: the A100's plan is the H200's (every class's first fits 163 KiB, Triton
    staging one copy fewer before sm_90), and fits."""
    for m in range(1, sg.MAX_M + 1):
        for n, k, gated in ((8192, 1536, False), (1536, 8192, False), (6144, 1536, True), (2048, 1536, False)):
            cfg = sg.plan(m, n, k, gated, SM80)
            assert cfg == sg.plan(m, n, k, gated, SM90) == sg.candidates(m, n, k, gated)[0]
            assert sg.pipeline_smem(cfg, m, gated, arch=SM80) <= SM80.smem_per_block
    # the deepest gate/up pipeline: five copies on sm_90 (180 KiB), four before it (144 KiB)
    deep = sg.plan(4, 6144, 1536, True, SM80)
    assert (sg.pipeline_smem(deep, 4, True, arch=SM90), sg.pipeline_smem(deep, 4, True, arch=SM80)) == (184320, 147456)


@settings(max_examples=examples(60))
@given(smem=st.integers(48 * 1024, 240 * 1024), hopper=st.booleans(), m=st.integers(1, 64),
       kind=st.sampled_from([(8192, 1536, False), (1536, 8192, False), (6144, 1536, True)]))
def test_skinny_plan_steps_its_pipeline_down_to_fit(smem, hopper, m, kind):
    """On any GPU (a smaller sm_8x included), the plan is its class's first with the deepest pipeline that fits."""
    gpu = GpuArch("gpu", 9 if hopper else 8, 6, smem, smem, 84)
    n, k, gated = kind
    first, cfg = sg.candidates(m, n, k, gated)[0], sg.plan(m, n, k, gated, gpu)
    assert cfg._replace(num_stages=first.num_stages) == first and cfg.num_stages <= first.num_stages
    fits = [s for s in range(1, first.num_stages + 1)
            if sg.pipeline_smem(first._replace(num_stages=s), m, gated, arch=gpu) <= smem]
    assert not first.dot or cfg.num_stages == (max(fits) if fits else 1)


# ---------------------------------------------------------------------------------------------------------------
# the switch


@pytest.fixture
def paths(monkeypatch):
    """Set GRAPHCAP_KERNEL_PATHS (None: unset) as a new process would read it."""
    def set_paths(value: str | None) -> None:
        monkeypatch.setenv(KERNEL_PATHS_ENV, value or "")  # recorded, so the test's end restores the variable
        if value is None:
            monkeypatch.delenv(KERNEL_PATHS_ENV)
        arch.kernel_paths.cache_clear()

    monkeypatch.setenv(arch.TRITON_ENV, "")  # the same for Triton's, which apply_triton_arch sets
    monkeypatch.delenv(arch.TRITON_ENV)
    yield set_paths
    monkeypatch.undo()
    arch.kernel_paths.cache_clear()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_switch_plans_what_an_a100_plans(paths, device):
    """Under GRAPHCAP_KERNEL_PATHS=sm80 every planner chooses what it chooses for the sm_80 description; unset (or
    native) what it chooses for the device's own (a CPU's: an H200's)."""
    gpu = device == "cuda" and torch.cuda.is_available()
    native = arch._native(torch.cuda.current_device()) if gpu else SM90
    for value, want in (("sm80", SM80), (" SM80 ", SM80), (None, None), ("native", None)):
        paths(value)
        expect = want.within(native) if want else native
        assert arch.device_arch(device) == expect
        assert want is None or native != SM90 or expect == SM80  # on an H200 (and a CPU): exactly an A100's
        for (kv, d, max_len), b, dtype in ((s, b, t) for s in (SLIDING, FULL) for b in BATCHES for t in FLOATS):
            assert plan_attention(b, kv, d, dtype, device, max_len) == \
                plan_attention(b, kv, d, dtype, device, max_len, arch=expect)
        for m in range(1, sg.MAX_M + 1):
            for n, k, gated in ((8192, 1536, False), (1536, 8192, False), (6144, 1536, True)):
                assert sg.plan(m, n, k, gated) == sg.plan(m, n, k, gated, expect)


def test_switch_sets_tritons_arch_and_names_bad_values(paths):
    paths("sm80")
    arch.apply_triton_arch()
    assert os.environ[arch.TRITON_ENV] == "sm80" and arch.triton_arch() == "sm80"
    os.environ[arch.TRITON_ENV] = "sm90"
    with pytest.raises(ValueError, match=r"^GRAPHCAP_KERNEL_PATHS=sm80 needs TRITON_OVERRIDE_ARCH=sm80 .*=sm90$"):
        arch.apply_triton_arch()
    paths(None)
    del os.environ[arch.TRITON_ENV]
    arch.apply_triton_arch()
    assert arch.TRITON_ENV not in os.environ and arch.triton_arch() is None
    paths("sm70")
    with pytest.raises(ValueError, match=r"^\$GRAPHCAP_KERNEL_PATHS: expected one of native, sm80 .*got 'sm70'$"):
        arch.device_arch("cpu")


def test_switch_names_every_description_graphcap_envvars_takes():
    """graphcap.envvars parses the switch without torch; every value it takes has its description here."""
    assert set(arch.PATHS) == set(FORCED_KERNEL_PATHS) and all(arch.PATHS[k].name == k for k in arch.PATHS)


def test_description_capped_by_the_device():
    """Forced onto a GPU smaller than an A100, every limit is the GPU's: nothing planned exceeds it."""
    sm86 = GpuArch("sm86", 8, 6, 101376, 102400, 84)
    assert SM80.within(SM90) == SM80
    capped = SM80.within(sm86)
    assert (capped.capability, capped.smem_per_block, capped.smem_per_sm, capped.sm_count) == ((8, 0), 101376,
                                                                                               102400, 84)
    assert not SM80.hopper and SM90.hopper
    with pytest.raises(ValueError, match=r"^GpuArch bad: sm_count must be an int >= 1, got 0$"):
        GpuArch("bad", 8, 0, 1, 1, 0)


def test_compile_cache_key_tells_the_switch(paths, monkeypatch):
    """A compile cache made on the default paths never loads under the switch (its kernels are other kernels)."""
    from graphcap.engine import compile_cache

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H200")
    keys = {}
    for value in (None, "sm80"):
        paths(value)
        keys[value] = compile_cache.cache_key(spec_hash="s", backend="cudagraph", buckets=[1], device="cuda")
    assert keys[None] != keys["sm80"]


# ---------------------------------------------------------------------------------------------------------------
# on a GPU


GPU_SCRIPT = """
import torch
import graphcap.kernels.gemm.skinny as sg
import graphcap.kernels.gemm.skinny_kernels as sgk
from graphcap.kernels import arch

assert arch.device_arch("cuda") == arch.SM80.within(arch._native(torch.cuda.current_device()))
g = torch.Generator(device="cuda").manual_seed(0)
for m, n, k, gated in ((4, 6144, 1536, True), (8, 8192, 1536, False)):
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(2 * n if gated else n, k, device="cuda", generator=g) * k ** -0.5).bfloat16()
    out = (sg.skinny_gate_up_gelu if gated else sg.skinny_linear)(x, w)
    ref = (sg.skinny_gate_up_gelu_torch if gated else sg.skinny_linear_torch)(x.double(), w.double())
    assert (out.double() - ref).norm() / ref.norm() < 1e-2
kernels = [k for cache in sgk.skinny_kernel.device_caches.values() for k in cache[0].values()]
assert kernels and all("wgmma" not in k.asm["ptx"] and "mma.sync" in k.asm["ptx"] for k in kernels)
print("sm80 paths", len(kernels))
"""


@pytest.mark.gpu
def test_switch_runs_the_a100_paths_on_this_gpu():
    """On a GPU under GRAPHCAP_KERNEL_PATHS=sm80: the skinny GEMM's kernels lowered for 80 (mma.sync, no wgmma)
    still compute the product (float64 reference)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_OVERRIDE_ARCH", "TRITON_INTERPRET")}
    env[KERNEL_PATHS_ENV] = "sm80"
    r = subprocess.run([sys.executable, "-c", GPU_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and "sm80 paths" in r.stdout, r.stderr[-3000:]
