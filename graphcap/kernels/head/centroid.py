"""The centroid LM head's scoring: each row's logits over the tokens of its top clusters, lm_head rows read in place.

The head (Gemma 4 assistant's clustered head) stores lm_head cluster-major: row `c * T + t` is the t-th token of
cluster c, so a cluster's T rows are one contiguous block. Per batch row b and chosen cluster j = top[b, j]:

    logits[b, j * T + t] = dot(lm_head[top[b, j] * T + t, :], x[b, :])        (fp32 accumulation, fp32 out)

`centroid_logits_torch` is the plain-torch twin, the gather-then-product math (sglang's too: gather the chosen
clusters' rows into a [B, k, T, H] copy, then a batched product in the weights' dtype, then fp32). The kernel reads
each chosen row once, straight from lm_head, and accumulates in fp32 - no [B, k, T, H] copy, which at the Gemma 4
shapes is 100 MB written and read again per step at batch 8.

Numerics: with fp32 weights kernel and twin agree to fp32 rounding. With bf16/fp16 weights the twin rounds each logit
to the weights' dtype (the batched product's output) before the cast to fp32; the kernel does not, so the two differ
by up to about half an ulp of that dtype per logit (bf16: 2**-9 relative) - the kernel is the closer to exact.

Cluster ids outside [0, C) are never dereferenced: their logits are NaN (the twin raises an index error instead).
Grid and output depend only on static shapes, never on a GPU value, so the op captures in a CUDA graph and traces
under torch.compile (a `torch.library.triton_op`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from graphcap.kernels import use_triton
from graphcap.kernels import pdl
from graphcap.kernels.pdl import pdl_start
from graphcap.kernels.checks import check_same_device, check_tensor

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
# The launch configuration, from lab/centroid_config.py's sweep on the H200 (lab/results/centroid-head-h200.json):
# 8 tokens per program at 2 warps was 17-22% faster than 16 at 4 at every batch 1-64 (more, smaller programs: at
# batch 1 the Gemma 4 head launches 32 x 16 = 512)
BLOCK_T = 8  # tokens per program
BLOCK_H = 256  # hidden columns per loop iteration (16-byte loads per thread in bf16: one warp covers a row's 256)
NUM_WARPS = 2


class CentroidHeadError(ValueError):
    """A bad argument to centroid_logits (named in the message)."""


def _check(lm_head: torch.Tensor, x: torch.Tensor, top: torch.Tensor, tokens_per_cluster: int) -> None:
    """Static checks only (shapes, dtypes, devices, strides): nothing that reads a GPU value."""
    op = "centroid_logits"
    check_tensor(CentroidHeadError, op, "lm_head", lm_head, DTYPES, 2)  # its row stride is free
    check_tensor(CentroidHeadError, op, "x", x, DTYPES, 2)
    check_tensor(CentroidHeadError, op, "top", top, INDEX_DTYPES, 2, contiguous_rows=False)  # a slice of topk's
    if x.dtype != lm_head.dtype:
        raise CentroidHeadError(f"centroid_logits: x ({x.dtype}) and lm_head ({lm_head.dtype}) dtypes differ")
    vocab, hidden = lm_head.shape
    if x.shape[1] != hidden:
        raise CentroidHeadError(f"centroid_logits: x has hidden size {x.shape[1]}, lm_head {tuple(lm_head.shape)} "
                                f"has {hidden}")
    if top.shape[0] != x.shape[0]:
        raise CentroidHeadError(f"centroid_logits: top has {top.shape[0]} rows, x has {x.shape[0]}")
    if isinstance(tokens_per_cluster, bool) or not isinstance(tokens_per_cluster, int) or tokens_per_cluster < 1:
        raise CentroidHeadError(f"centroid_logits: tokens_per_cluster must be an int >= 1, got {tokens_per_cluster!r}")
    if vocab % tokens_per_cluster:
        raise CentroidHeadError(f"centroid_logits: tokens_per_cluster {tokens_per_cluster} must divide lm_head's "
                                f"{vocab} rows")
    check_same_device(CentroidHeadError, op, lm_head=lm_head, x=x, top=top)


# ---------------------------------------------------------------------------------------------------------------
# plain-torch twin


def centroid_logits_torch(lm_head: torch.Tensor, x: torch.Tensor, top: torch.Tensor,
                          tokens_per_cluster: int) -> torch.Tensor:
    """Twin of the kernel: gather the chosen clusters' rows, batched product in the inputs' dtype, fp32 out.
    Static shapes only, so it traces under torch.compile. lm_head's row stride is free (the view splits rows only)."""
    clusters = lm_head.shape[0] // tokens_per_cluster
    rows = lm_head.view(clusters, tokens_per_cluster, -1)[top]  # [B, k, T, H]: a copy
    return torch.einsum("bkth,bh->bkt", rows, x).flatten(1).float()


# ---------------------------------------------------------------------------------------------------------------
# Triton kernel


@triton.jit
def _centroid_logits_kernel(
    lm_head, x, top, out, clusters, stride_w, stride_xb, stride_tb, stride_tk, stride_ob,
    K: tl.constexpr, T: tl.constexpr, H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    GDC: tl.constexpr = False,
):
    pdl_start(GDC)
    # program (b * K + j, t-block): BLOCK_T rows of cluster top[b, j], each dotted with x[b]
    pid = tl.program_id(0)
    b = (pid // K).to(tl.int64)
    j = pid % K
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.load(top + b * stride_tb + j * stride_tk).to(tl.int64)
    valid = (c >= 0) & (c < clusters)  # never read outside lm_head, whatever top holds
    mask_t = offs_t < tl.where(valid, T, 0)  # an invalid cluster reads no rows
    rows = lm_head + (tl.where(valid, c, 0) * T + offs_t)[:, None].to(tl.int64) * stride_w
    x_row = x + b * stride_xb
    # Elementwise products summed at the end, not tl.dot: x is one vector per program (a GEMV, bound by reading
    # the rows), and Triton's CPU interpreter mis-computes tl.dot on bf16 tiles.
    acc = tl.zeros([BLOCK_T, BLOCK_H], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        xv = tl.load(x_row + offs_h, mask=mask_h, other=0.0).to(tl.float32)
        w = tl.load(rows + offs_h[None, :], mask=mask_t[:, None] & mask_h[None, :], other=0.0)
        acc += w.to(tl.float32) * xv[None, :]
    logits = tl.where(valid, tl.sum(acc, 1), float("nan"))
    tl.store(out + b * stride_ob + j * T + offs_t, logits, mask=offs_t < T)


def launch(lm_head: torch.Tensor, x: torch.Tensor, top: torch.Tensor, tokens_per_cluster: int,
            block_t: int = BLOCK_T, block_h: int = BLOCK_H, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """The kernel's launch; the block sizes and warps are parameters for lab/centroid_config.py's sweep."""
    b, k = top.shape
    t = tokens_per_cluster
    h = lm_head.shape[1]
    out = torch.empty((b, k * t), dtype=torch.float32, device=x.device)
    if b == 0 or k == 0:
        return out
    block_t = min(block_t, triton.next_power_of_2(t))
    block_h = min(block_h, max(16, triton.next_power_of_2(h)))
    wrap_triton(_centroid_logits_kernel)[(b * k, triton.cdiv(t, block_t))](
        lm_head, x, top, out, lm_head.shape[0] // t, lm_head.stride(0), x.stride(0), top.stride(0), top.stride(1),
        out.stride(0), K=k, T=t, H=h, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=num_warps, **pdl.launch_options(x),
    )
    return out


# ---------------------------------------------------------------------------------------------------------------
# the op


def centroid_logits(lm_head: torch.Tensor, x: torch.Tensor, top: torch.Tensor, tokens_per_cluster: int) -> torch.Tensor:
    """Logits of each row's chosen clusters' tokens: [B, k * T] fp32, entry (b, j * T + t) the dot of lm_head row
    `top[b, j] * T + t` with x[b].

    lm_head [C * T, H] cluster-major (row stride free, columns contiguous), x [B, H] in lm_head's dtype, top [B, k]
    int32/int64 cluster ids in [0, C), tokens_per_cluster T. The Triton kernel where Triton runs (CUDA; CPU under
    TRITON_INTERPRET=1), the twin elsewhere.
    """
    _check(lm_head, x, top, tokens_per_cluster)  # here too: the op's schema would reject a bad type first, unnamed
    return _centroid_logits_op(lm_head, x, top, tokens_per_cluster)


@triton_op("graphcap::centroid_logits", mutates_args=())
def _centroid_logits_op(lm_head: torch.Tensor, x: torch.Tensor, top: torch.Tensor,
                        tokens_per_cluster: int) -> torch.Tensor:
    """The registered op behind `centroid_logits` (traceable by torch.compile, capturable in a CUDA graph)."""
    _check(lm_head, x, top, tokens_per_cluster)
    if not use_triton(x):
        return centroid_logits_torch(lm_head, x, top, tokens_per_cluster)
    return launch(lm_head, x, top, tokens_per_cluster)
