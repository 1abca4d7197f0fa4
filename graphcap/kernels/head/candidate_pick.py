"""The greedy token of a centroid head's candidates in one kernel: the largest candidate logit and, on a tie, the
smallest vocabulary id among the tied - what `max` over the full-vocabulary row (mask value outside the candidates)
returns - without that row, and without a [B, k * T] tensor of candidate ids.

The head's candidates for row b: values[b, j * T + t], the logit of token `token_ordering[top[b, j] * T + t]` (the
t-th token of the row's j-th chosen cluster; `centroid.centroid_logits` computes them). Per row:

    logit[b] = max_n values[b, n]                       (NaN where the row holds a NaN, as torch.max)
    token[b] = min { id(b, n) : values[b, n] >= logit[b] }   (every candidate where logit[b] is NaN)

`candidate_greedy_torch` is the plain-torch twin: gather every candidate's id, max, then the smallest id among the
maxima (four small kernels and a [B, k * T] int64 copy on a GPU). The kernel runs one program per row: the row's
values in registers, the max, then the ids looked up for the tied entries only (masked loads) and their min.

Cluster ids outside [0, C) are never dereferenced: their entries take no part in the token's min (the twin raises an
index error instead), and a row with no candidate left returns `NO_TOKEN`. Grid and outputs depend only on static
shapes, so the op captures in a CUDA graph and traces under torch.compile (a `torch.library.triton_op`).
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
NO_TOKEN = torch.iinfo(torch.int64).max  # above every token id: never the smallest of a row's ties
MAX_N = 16384  # the longest candidate row held in registers (fp32: 32 per thread at 16 warps)


class CandidatePickError(ValueError):
    """A bad argument to candidate_greedy (named in the message)."""


def _check(values: torch.Tensor, top: torch.Tensor, token_ordering: torch.Tensor, tokens_per_cluster: int) -> None:
    """Static checks only (shapes, dtypes, devices, strides): nothing that reads a GPU value."""
    op = "candidate_greedy"
    check_tensor(CandidatePickError, op, "values", values, DTYPES, 2)
    check_tensor(CandidatePickError, op, "top", top, INDEX_DTYPES, 2)
    check_tensor(CandidatePickError, op, "token_ordering", token_ordering, INDEX_DTYPES, 1)
    if isinstance(tokens_per_cluster, bool) or not isinstance(tokens_per_cluster, int) or tokens_per_cluster < 1:
        raise CandidatePickError(f"candidate_greedy: tokens_per_cluster must be an int >= 1, "
                                 f"got {tokens_per_cluster!r}")
    rows, n = values.shape
    if top.shape[0] != rows or top.shape[1] * tokens_per_cluster != n:
        raise CandidatePickError(f"candidate_greedy: values {tuple(values.shape)} must be [rows, k * T] for top "
                                 f"{tuple(top.shape)} ([rows, k]) and T = {tokens_per_cluster}")
    if n == 0:
        raise CandidatePickError("candidate_greedy: values has no candidates (k * T = 0)")
    if token_ordering.shape[0] % tokens_per_cluster:
        raise CandidatePickError(f"candidate_greedy: tokens_per_cluster {tokens_per_cluster} must divide "
                                 f"token_ordering's {token_ordering.shape[0]} entries")
    check_same_device(CandidatePickError, op, values=values, top=top, token_ordering=token_ordering)


# ---------------------------------------------------------------------------------------------------------------
# plain-torch twin


def candidate_greedy_torch(values: torch.Tensor, top: torch.Tensor, token_ordering: torch.Tensor,
                           tokens_per_cluster: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of the kernel: every candidate's id gathered, then the max and the smallest id among the maxima."""
    rows = values.shape[0]
    ids = token_ordering.long().view(-1, tokens_per_cluster)[top].view(rows, -1)
    best = values.max(dim=-1, keepdim=True).values  # NaN where the row has one, as torch.max
    token = torch.where(values < best, NO_TOKEN, ids).amin(dim=-1)  # `< NaN` is false: every candidate
    return token, best.squeeze(-1).float()


# ---------------------------------------------------------------------------------------------------------------
# Triton kernel


@triton.jit
def _candidate_greedy_kernel(values, top, token_ordering, token, logit, clusters, stride_vb, stride_tb,
                             N: tl.constexpr, T: tl.constexpr, BLOCK_N: tl.constexpr, GDC: tl.constexpr = False):
    pdl_start(GDC)
    # program b: row b's largest candidate and the smallest id among its ties (module docstring)
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    live = offs < N
    v = tl.load(values + b * stride_vb + offs, mask=live, other=float("-inf")).to(tl.float32)
    nan = v != v
    has_nan = tl.max(nan.to(tl.int32), 0) > 0
    best = tl.max(tl.where(nan, float("-inf"), v), 0)  # the NaN rule is ours, not the hardware max's
    # a row holding a NaN ties every candidate (NaN entries included), as `values < NaN` is false in the twin
    tied = live & ((v >= tl.where(has_nan, float("-inf"), best)) | nan)
    best = tl.where(has_nan, float("nan"), best)
    c = tl.load(top + b * stride_tb + offs // T, mask=tied, other=-1).to(tl.int64)
    ok = tied & (c >= 0) & (c < clusters)  # never read outside token_ordering, whatever top holds
    ids = tl.load(token_ordering + tl.where(ok, c, 0) * T + offs % T, mask=ok, other=0).to(tl.int64)
    tl.store(token + b, tl.min(tl.where(ok, ids, 9223372036854775807), 0))  # NO_TOKEN where nothing is left
    tl.store(logit + b, best)


def warps_for(block_n: int) -> int:
    """Warps per program: ~1024 entries per warp, 1 to 16 (4096 candidates: 4 warps)."""
    return max(1, min(16, block_n // 1024))


def launch(values: torch.Tensor, top: torch.Tensor, token_ordering: torch.Tensor,
            tokens_per_cluster: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n = values.shape
    token = torch.empty(rows, dtype=torch.int64, device=values.device)
    logit = torch.empty(rows, dtype=torch.float32, device=values.device)
    if rows == 0:
        return token, logit
    block_n = max(16, triton.next_power_of_2(n))
    wrap_triton(_candidate_greedy_kernel)[(rows,)](
        values, top, token_ordering, token, logit, token_ordering.shape[0] // tokens_per_cluster, values.stride(0),
        top.stride(0), N=n, T=tokens_per_cluster, BLOCK_N=block_n, num_warps=warps_for(block_n),
        **pdl.launch_options(values),
    )
    return token, logit


# ---------------------------------------------------------------------------------------------------------------
# the op


def candidate_greedy(values: torch.Tensor, top: torch.Tensor, token_ordering: torch.Tensor,
                     tokens_per_cluster: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's greedy token (int64 [rows]) and its logit (fp32 [rows]) among the centroid head's candidates:
    the largest value, the smallest vocabulary id among equal values (module docstring).

    values [rows, k * T] bf16/fp16/fp32 (entry j * T + t: the t-th token of cluster top[:, j]), top [rows, k] and
    token_ordering [C * T] int32/int64 (the vocabulary id of cluster c's t-th token at c * T + t). The Triton kernel
    where Triton runs (CUDA; CPU under TRITON_INTERPRET=1) and k * T <= MAX_N, the twin elsewhere.
    """
    _check(values, top, token_ordering, tokens_per_cluster)  # here too: the schema would reject a bad type unnamed
    return _candidate_greedy_op(values, top, token_ordering, tokens_per_cluster)


@triton_op("graphcap::candidate_greedy", mutates_args=())
def _candidate_greedy_op(values: torch.Tensor, top: torch.Tensor, token_ordering: torch.Tensor,
                         tokens_per_cluster: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The registered op behind `candidate_greedy` (traceable by torch.compile, capturable in a CUDA graph)."""
    _check(values, top, token_ordering, tokens_per_cluster)
    if not use_triton(values) or values.shape[1] > MAX_N:
        return candidate_greedy_torch(values, top, token_ordering, tokens_per_cluster)
    return launch(values, top, token_ordering, tokens_per_cluster)
