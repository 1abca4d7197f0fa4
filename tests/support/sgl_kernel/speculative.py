"""The two EAGLE tree ops sglang 0.5.18 launches from `sgl_kernel` on CUDA (0.5.23 has its own JIT kernels), one
Triton kernel each, beside a plain-torch twin (`*_torch`, serial Python over the batch: the tests' reference and the
fallback where Triton cannot run). Names, argument order, dtypes and in-place outputs are sgl_kernel's
(`sgl_kernel/speculative.py`, whose name this module takes; the CUDA kernels `build_tree_efficient`,
`VerifyTreeGreedy`). `fast_topk`, the third op, is in `top_k` beside it.

Tree layout (built by sglang's `organize_draft_results` from the draft loop's top-k): request b's tree has D =
`draft_token_num` nodes; node 0 is the root (the bonus token), node i >= 1 the draft token whose index in the
flattened score list is `selected_index[b, i - 1]`. That index // topk is its parent's block: 0 for the first step's
tokens (parent: the root), else `parent_list[b, block]` is the parent's score index, and the parent is the node
whose `selected_index` entry equals it (the first such). `parent_list` is [bs, topk * (depth - 1) + 1] (any width
when depth == 1: nothing reads it).

`build_tree_kernel_efficient(parent_list, selected_index, verified_seq_len, tree_mask, positions, retrive_index,
retrive_next_token, retrive_next_sibling, topk, depth, draft_token_num, tree_mask_mode) -> None` writes, per b:
- `positions[b * D + i] = verified_seq_len[b] + ` the number of draft nodes on the path from the root to i (i
  included; the root: 0);
- `retrive_index[b, i] = b * D + i`;
- `retrive_next_token[b, p]` = p's smallest child and `retrive_next_sibling[b, i]` = the next larger node with i's
  parent, written only where such a node exists: the caller fills both with -1 first (sglang does; sgl_kernel's
  kernel relies on it too);
- the tree mask, row i true at the root, at i and at i's ancestors, false at the other tree columns. Modes (sglang's
  TreeMaskMode): 0 FULL_MASK - row i of request b is `seq_len + D` bytes at `D*D*b + D*sum(seq_len[:b]) + (seq_len +
  D) * i`, of which the kernel writes the D tree columns (the prefix is the caller's fill); 1 QLEN_ONLY - D bytes at
  `D*D*b + D*i`; 2 QLEN_ONLY_BITPACKING - bit j of the `nbytes` little-endian bytes at `(b*D + i) * nbytes`, nbytes
  = 1, 2 or 4 for D <= 8, 16, 32 (written whole; sgl_kernel ORs the bits into the zeros sglang fills: the same
  bytes). The mask's dtype is free (bool, uint8, uint16/32 when packed): it is written as bytes.
An invalid tree (a node whose parent was not selected: sgl_kernel prints a warning for it) gets no link, and its
mask row and position stop at it - as sglang's own Triton version (`spec_tree.py`), where sgl_kernel's CUDA kernel
walks past the row. D <= MAX_TREE_DRAFT_TOKENS (the kernel holds D x D tiles in registers; sgl_kernel's limit is
1024): larger raises NotImplementedError naming the op.

`verify_tree_greedy(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
retrive_next_sibling, target_predict) -> None`: from the root, at each of S - 1 levels (S = accept_index.shape[1]),
the first child of the last accepted node (its list: `retrive_next_token` at the node, then `retrive_next_sibling`)
whose candidate token equals the target's greedy
token after that node (`target_predict` at the node's retrieve index, a flat index over [bs, D]) is accepted; the
walk stops at the first level with none. Writes `accept_index[b, k]` (the accepted nodes' retrieve indices, the root
at k = 0), `accept_token_num[b]` (drafts accepted) and `predicts[r] = target_predict[r]` at each accepted retrieve
index r (the root's included); other entries stay as they were. Any tree shape (topk > 1 too).

Checks are static (shapes, dtypes, devices, strides), never a GPU value: both ops launch without a sync. It imports
nothing of the stand-in package, so tests load it in their own process without it (tests/standin_ops.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from graphcap.kernels import use_triton
from graphcap.kernels.checks import check_same_device

MAX_TREE_DRAFT_TOKENS = 64  # build_tree: D x D tiles per program (128 would spill registers)
MASK_MODES = {0: "FULL_MASK", 1: "QLEN_ONLY", 2: "QLEN_ONLY_BITPACKING"}


class SpecOpError(ValueError):
    """Bad input to a speculative-decoding op; the message names the op and the argument."""


# ---------------------------------------------------------------------------------------------------------------
# checks


def _int(op: str, name: str, v: object, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise SpecOpError(f"{op}: {name} must be an int >= {lo}, got {v!r}")
    return v


def _tensor(op: str, name: str, x: object, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if not isinstance(x, torch.Tensor):
        raise SpecOpError(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != dtype or tuple(x.shape) != shape:
        raise SpecOpError(f"{op}: {name} must be a tensor of dtype {str(dtype).replace('torch.', '')} and shape "
                          f"{shape}, got {x.dtype} {tuple(x.shape)}")
    if x.numel() and x.stride(-1) != 1:
        raise SpecOpError(f"{op}: {name}'s last dimension must be contiguous (stride 1), got strides {x.stride()}")


def _mask_bytes(d: int) -> int:
    return 4 if d > 16 else 2 if d > 8 else 1


def _check_build(parent_list: torch.Tensor, selected_index: torch.Tensor, verified_seq_len: torch.Tensor,
                 tree_mask: torch.Tensor, positions: torch.Tensor, retrive_index: torch.Tensor,
                 retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor, topk: int, depth: int,
                 draft_token_num: int, tree_mask_mode: int) -> None:
    op = "build_tree_kernel_efficient"
    topk, depth, d = _int(op, "topk", topk, 1), _int(op, "depth", depth, 1), _int(op, "draft_token_num",
                                                                                  draft_token_num, 1)
    if isinstance(tree_mask_mode, bool) or tree_mask_mode not in MASK_MODES:
        raise SpecOpError(f"{op}: tree_mask_mode must be one of {MASK_MODES}, got {tree_mask_mode!r}")
    if not isinstance(verified_seq_len, torch.Tensor) or verified_seq_len.ndim != 1:
        raise SpecOpError(f"{op}: verified_seq_len must be a 1-D int64 tensor [bs], got "
                          f"{getattr(verified_seq_len, 'shape', type(verified_seq_len).__name__)}")
    bs = verified_seq_len.shape[0]
    _tensor(op, "verified_seq_len", verified_seq_len, torch.int64, (bs,))
    if not isinstance(parent_list, torch.Tensor) or parent_list.ndim != 2:
        raise SpecOpError(f"{op}: parent_list must be a 2-D int64 tensor [bs, topk * (depth - 1) + 1]")
    width = parent_list.shape[1]
    if depth > 1 and width != topk * (depth - 1) + 1:
        raise SpecOpError(f"{op}: parent_list must have topk * (depth - 1) + 1 = {topk * (depth - 1) + 1} columns "
                          f"(topk {topk}, depth {depth}), got {width}")
    _tensor(op, "parent_list", parent_list, torch.int64, (bs, width))
    _tensor(op, "selected_index", selected_index, torch.int64, (bs, d - 1))
    _tensor(op, "positions", positions, torch.int64, (bs * d,))
    for name, t in (("retrive_index", retrive_index), ("retrive_next_token", retrive_next_token),
                    ("retrive_next_sibling", retrive_next_sibling)):
        _tensor(op, name, t, torch.int64, (bs, d))
    if not isinstance(tree_mask, torch.Tensor) or tree_mask.ndim != 1 or (tree_mask.numel() and
                                                                          tree_mask.stride(0) != 1):
        raise SpecOpError(f"{op}: tree_mask must be a contiguous 1-D tensor (its bytes are the mask)")
    need = {0: 0, 1: bs * d * d, 2: bs * d * _mask_bytes(d)}[tree_mask_mode]  # FULL_MASK's size needs seq_lens' sum
    if tree_mask.numel() * tree_mask.element_size() < need:
        raise SpecOpError(f"{op}: tree_mask holds {tree_mask.numel() * tree_mask.element_size()} bytes, "
                          f"{MASK_MODES[tree_mask_mode]} writes {need}")
    check_same_device(SpecOpError, op, parent_list=parent_list, selected_index=selected_index,
                      verified_seq_len=verified_seq_len, tree_mask=tree_mask, positions=positions,
                      retrive_index=retrive_index, retrive_next_token=retrive_next_token,
                      retrive_next_sibling=retrive_next_sibling)
    if tree_mask_mode == 2 and d > 32:
        raise NotImplementedError(f"{op}: QLEN_ONLY_BITPACKING holds at most 32 draft tokens (as sgl_kernel), got "
                                  f"draft_token_num {d}")
    if d > MAX_TREE_DRAFT_TOKENS:
        raise NotImplementedError(f"{op}: graphcap's kernel builds trees of at most {MAX_TREE_DRAFT_TOKENS} draft "
                                  f"tokens, got draft_token_num {d}")


def _check_verify(predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor,
                  candidates: torch.Tensor, retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
                  retrive_next_sibling: torch.Tensor, target_predict: torch.Tensor) -> None:
    op = "verify_tree_greedy"
    if not isinstance(candidates, torch.Tensor) or candidates.ndim != 2:
        raise SpecOpError(f"{op}: candidates must be a 2-D int64 tensor [bs, num_draft_tokens]")
    bs, d = candidates.shape
    if not isinstance(accept_index, torch.Tensor) or accept_index.ndim != 2:
        raise SpecOpError(f"{op}: accept_index must be a 2-D int32 tensor [bs, num_spec_tokens]")
    s = accept_index.shape[1]
    if d < 1 or s < 1:
        raise SpecOpError(f"{op}: candidates and accept_index need at least one column, got {d} and {s}")
    for name, t in (("candidates", candidates), ("retrive_index", retrive_index),
                    ("retrive_next_token", retrive_next_token), ("retrive_next_sibling", retrive_next_sibling),
                    ("target_predict", target_predict)):
        _tensor(op, name, t, torch.int64, (bs, d))
    _tensor(op, "accept_index", accept_index, torch.int32, (bs, s))
    _tensor(op, "accept_token_num", accept_token_num, torch.int32, (bs,))
    _tensor(op, "predicts", predicts, torch.int32, (bs * d,))
    check_same_device(SpecOpError, op, predicts=predicts, accept_index=accept_index,
                      accept_token_num=accept_token_num, candidates=candidates, retrive_index=retrive_index,
                      retrive_next_token=retrive_next_token, retrive_next_sibling=retrive_next_sibling,
                      target_predict=target_predict)


# ---------------------------------------------------------------------------------------------------------------
# plain-torch twins: serial Python over each request, the semantics written out


def _parents(sel: list[int], par_row: list[int], topk: int) -> list[int]:
    """Each node's parent node: 0 for the root's children, -1 for the root and for a node whose parent is missing."""
    out = [-1]
    for s in sel:
        block = s // topk
        if block == 0:
            out.append(0)
        elif 0 < block < len(par_row) and par_row[block] in sel:
            out.append(sel.index(par_row[block]) + 1)
        else:
            out.append(-1)
    return out


def build_tree_kernel_efficient_torch(parent_list: torch.Tensor, selected_index: torch.Tensor,
                                      verified_seq_len: torch.Tensor, tree_mask: torch.Tensor, positions: torch.Tensor,
                                      retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
                                      retrive_next_sibling: torch.Tensor, topk: int, depth: int, draft_token_num: int,
                                      tree_mask_mode: int) -> None:
    """Twin of `build_tree_kernel_efficient` (module docstring), in place."""
    _check_build(parent_list, selected_index, verified_seq_len, tree_mask, positions, retrive_index,
                 retrive_next_token, retrive_next_sibling, topk, depth, draft_token_num, tree_mask_mode)
    d = draft_token_num
    mask = tree_mask.view(torch.uint8).cpu()
    pos, nxt, sib = positions.cpu(), retrive_next_token.cpu(), retrive_next_sibling.cpu()
    nbytes, start = _mask_bytes(d), 0
    for b, (sel, par_row, seq_len) in enumerate(zip(selected_index.tolist(), parent_list.tolist(),
                                                    verified_seq_len.tolist())):
        par = _parents(sel, par_row, topk)
        for i in range(d):
            kids = [j for j in range(1, d) if par[j] == i]
            if kids:
                nxt[b, i] = kids[0]
                for a, c in zip(kids, kids[1:]):
                    sib[b, a] = c
            path, j = set(), i
            while j > 0 and j not in path:
                path.add(j)
                j = par[j]
            pos[b * d + i] = seq_len + len(path)
            row = [1] + [int(j in path) for j in range(1, d)]
            if tree_mask_mode == 2:
                at = (b * d + i) * nbytes
                mask[at:at + nbytes] = torch.tensor([sum(row[8 * k + t] << t for t in range(8) if 8 * k + t < d)
                                                     for k in range(nbytes)], dtype=torch.uint8)
            else:
                at = d * d * b + (d * start + (seq_len + d) * i + seq_len if tree_mask_mode == 0 else d * i)
                mask[at:at + d] = torch.tensor(row, dtype=torch.uint8)
        start += seq_len
    tree_mask.view(torch.uint8).copy_(mask)
    positions.copy_(pos)
    retrive_next_token.copy_(nxt)
    retrive_next_sibling.copy_(sib)
    bs = verified_seq_len.shape[0]
    retrive_index.copy_(torch.arange(bs * d, dtype=torch.int64).view(bs, d))


def verify_tree_greedy_torch(predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor,
                             candidates: torch.Tensor, retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
                             retrive_next_sibling: torch.Tensor, target_predict: torch.Tensor) -> None:
    """Twin of `verify_tree_greedy` (module docstring), in place."""
    _check_verify(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                  retrive_next_sibling, target_predict)
    d, s = candidates.shape[1], accept_index.shape[1]
    pred, acc, num = predicts.cpu(), accept_index.cpu(), accept_token_num.cpu()
    target = target_predict.tolist()
    for b, (cand, ridx, nxt, sib) in enumerate(zip(candidates.tolist(), retrive_index.tolist(),
                                                   retrive_next_token.tolist(), retrive_next_sibling.tolist())):
        path = [0]
        for _ in range(1, s):
            want = target[ridx[path[-1]] // d][ridx[path[-1]] % d]
            cur, hops = nxt[path[-1]], 0
            while 0 <= cur < d and hops < d and cand[cur] != want:
                cur, hops = sib[cur], hops + 1
            if not (0 <= cur < d and hops < d):
                break
            path.append(cur)
        num[b] = len(path) - 1
        for k, node in enumerate(path):
            acc[b, k] = ridx[node]
            pred[ridx[node]] = target[ridx[node] // d][ridx[node] % d]
    predicts.copy_(pred)
    accept_index.copy_(acc)
    accept_token_num.copy_(num)


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels: one program per request


@triton.jit
def _build_tree_kernel(parent_list, selected, seq_lens, mask, positions, r_index, r_next, r_sib,
                       par_stride, par_width, sel_stride, ri_stride, rn_stride, rs_stride, topk, D,
                       MODE: tl.constexpr, NBYTES: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BLOCK_D)  # node i (0: the root)
    cols = tl.arange(0, BLOCK_D)  # node j
    draft = (rows >= 1) & (rows < D)
    # par[i]: node i's parent node (0: the root; -1: none, for the root, padding and orphans)
    sel = tl.load(selected + b * sel_stride + rows - 1, mask=draft, other=0)
    block = sel // topk
    inside = (block > 0) & (block < par_width)
    ptok = tl.load(parent_list + b * par_stride + block, mask=draft & inside, other=-1)
    sel_c = tl.load(selected + b * sel_stride + cols, mask=cols < D - 1, other=0)
    hit = (sel_c[None, :] == ptok[:, None]) & (cols[None, :] < D - 1)
    first = tl.min(tl.where(hit, cols[None, :], BLOCK_D), 1)
    par = tl.where(block == 0, 0, tl.where(inside & (first < BLOCK_D), first + 1, -1))
    par = tl.where(draft, par, -1)

    # links: p's first child is its smallest child; i's next sibling the smallest larger node with i's parent
    kids = par[None, :] == rows[:, None]
    first_kid = tl.min(tl.where(kids, cols[None, :], BLOCK_D), 1)
    tl.store(r_next + b * rn_stride + rows, first_kid.to(tl.int64), mask=(rows < D) & (first_kid < BLOCK_D))
    sibs = (par[None, :] == par[:, None]) & (cols[None, :] > rows[:, None]) & (par[:, None] >= 0)
    next_sib = tl.min(tl.where(sibs, cols[None, :], BLOCK_D), 1)
    tl.store(r_sib + b * rs_stride + rows, next_sib.to(tl.int64), mask=(rows < D) & (next_sib < BLOCK_D))
    tl.store(r_index + b * ri_stride + rows, b * D + rows, mask=rows < D)

    # on[i, j]: node j is on the root's path to node i (the root and i included); a path has at most D - 1 drafts
    on = (cols[None, :] == 0) & (rows[:, None] < D)
    cur = tl.where(draft, rows, -1)
    for _ in range(D - 1):
        at = cols[None, :] == cur[:, None]
        on = on | (at & (cur[:, None] > 0))
        up = tl.sum(tl.where(at, par[None, :], 0), 1)
        cur = tl.where(cur > 0, up, -1)
    seq_len = tl.load(seq_lens + b)
    depth = tl.sum((on & (cols[None, :] > 0)).to(tl.int64), 1)
    tl.store(positions + b * D + rows, seq_len + depth, mask=rows < D)

    cell = (rows[:, None] < D) & (cols[None, :] < D)
    if MODE == 2:  # bit j of row i's NBYTES little-endian bytes
        for k in tl.static_range(NBYTES):
            in_byte = on & (cols[None, :] >= 8 * k) & (cols[None, :] < 8 * k + 8)
            byte = tl.sum(tl.where(in_byte, 1 << (cols[None, :] % 8), 0), 1)
            tl.store(mask + (b * D + rows) * NBYTES + k, byte.to(tl.uint8), mask=rows < D)
    elif MODE == 1:
        row_at = D * D * b + D * rows
        tl.store(mask + row_at[:, None] + cols[None, :], on.to(tl.uint8), mask=cell)
    else:  # FULL_MASK: the tree columns of rows that start after every earlier request's rows
        acc = tl.zeros([BLOCK_B], tl.int64)
        for start in range(0, b, BLOCK_B):
            offs = start + tl.arange(0, BLOCK_B)
            acc += tl.load(seq_lens + offs, mask=offs < b, other=0)
        row_at = D * D * b + D * tl.sum(acc, 0) + (seq_len + D) * rows + seq_len
        tl.store(mask + row_at[:, None] + cols[None, :], on.to(tl.uint8), mask=cell)


@triton.jit
def _verify_greedy_kernel(predicts, accept_index, accept_num, candidates, r_index, r_next, r_sib, target,
                          c_stride, ri_stride, rn_stride, rs_stride, t_stride, a_stride, D, S):
    # a serial walk of scalar loads (the row stays in L1); `last` is the last accepted node's retrieve index, a flat
    # index over [bs, D], as target_predict and predicts are read and written
    b = tl.program_id(0).to(tl.int64)
    last = tl.load(r_index + b * ri_stride)
    tl.store(accept_index + b * a_stride, last.to(tl.int32))
    node = last * 0  # the last accepted node (0: the root)
    n = (last * 0).to(tl.int32)  # drafts accepted
    going = last == last
    for _ in range(1, S):
        want = tl.load(target + (last // D) * t_stride + last % D)
        cur = tl.load(r_next + b * rn_stride + node, mask=going, other=-1)
        found = last != last
        for _hop in range(D - 1):  # the sibling list holds at most D - 1 drafts; cur stays on the first match
            live = (cur >= 0) & (cur < D) & ~found
            found = found | (live & (tl.load(candidates + b * c_stride + cur, mask=live, other=0) == want))
            step = live & ~found
            cur = tl.where(step, tl.load(r_sib + b * rs_stride + cur, mask=step, other=-1), cur)
        tl.store(predicts + last, want.to(tl.int32), mask=found)  # the target's token after `last` was drafted
        r = tl.load(r_index + b * ri_stride + cur, mask=found, other=0)
        n += found.to(tl.int32)
        tl.store(accept_index + b * a_stride + n, r.to(tl.int32), mask=found)
        last = tl.where(found, r, last)
        node = tl.where(found, cur, node)
        going = going & found
    tl.store(accept_num + b, n)
    tl.store(predicts + last, tl.load(target + (last // D) * t_stride + last % D).to(tl.int32))


def _warps(block: int) -> int:
    """Warps for a block x block tile: 1 up to 16 x 16, then 2 per doubling of the tile, at most 16. Untuned."""
    return max(1, min(16, block * block // 256))


@triton_op("graphcap::build_tree_kernel_efficient",
           mutates_args={"tree_mask", "positions", "retrive_index", "retrive_next_token", "retrive_next_sibling"})
def _build_tree_op(parent_list: torch.Tensor, selected_index: torch.Tensor, verified_seq_len: torch.Tensor,
                   tree_mask: torch.Tensor, positions: torch.Tensor, retrive_index: torch.Tensor,
                   retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor, topk: int, depth: int,
                   draft_token_num: int, tree_mask_mode: int) -> None:
    bs, d = verified_seq_len.shape[0], draft_token_num
    if bs == 0:
        return
    # an empty tensor has no pointer Triton accepts: nothing reads these when they are empty
    sel = selected_index if selected_index.numel() else positions
    par = parent_list if parent_list.numel() else positions
    block = max(2, triton.next_power_of_2(d))
    wrap_triton(_build_tree_kernel)[(bs,)](
        par, sel, verified_seq_len, tree_mask.view(torch.uint8), positions, retrive_index, retrive_next_token,
        retrive_next_sibling, parent_list.stride(0), parent_list.shape[1], selected_index.stride(0),
        retrive_index.stride(0), retrive_next_token.stride(0), retrive_next_sibling.stride(0), topk, d,
        MODE=tree_mask_mode, NBYTES=_mask_bytes(d), BLOCK_D=block, BLOCK_B=256, num_warps=_warps(block))


@triton_op("graphcap::verify_tree_greedy", mutates_args={"predicts", "accept_index", "accept_token_num"})
def _verify_op(predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor,
               candidates: torch.Tensor, retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
               retrive_next_sibling: torch.Tensor, target_predict: torch.Tensor) -> None:
    bs, d = candidates.shape
    s = accept_index.shape[1]
    if bs == 0:
        return
    wrap_triton(_verify_greedy_kernel)[(bs,)](
        predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
        retrive_next_sibling, target_predict, candidates.stride(0), retrive_index.stride(0),
        retrive_next_token.stride(0), retrive_next_sibling.stride(0), target_predict.stride(0),
        accept_index.stride(0), d, s, num_warps=1)


# ---------------------------------------------------------------------------------------------------------------
# the ops, with sgl_kernel's names and signatures


def build_tree_kernel_efficient(parent_list: torch.Tensor, selected_index: torch.Tensor,
                                verified_seq_len: torch.Tensor, tree_mask: torch.Tensor, positions: torch.Tensor,
                                retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
                                retrive_next_sibling: torch.Tensor, topk: int, depth: int, draft_token_num: int,
                                tree_mask_mode: int) -> None:
    """sgl_kernel.build_tree_kernel_efficient (module docstring): the Triton kernel where Triton runs, else the twin."""
    _check_build(parent_list, selected_index, verified_seq_len, tree_mask, positions, retrive_index,
                 retrive_next_token, retrive_next_sibling, topk, depth, draft_token_num, tree_mask_mode)
    args = (parent_list, selected_index, verified_seq_len, tree_mask, positions, retrive_index, retrive_next_token,
            retrive_next_sibling, topk, depth, draft_token_num, int(tree_mask_mode))
    if use_triton(verified_seq_len):
        _build_tree_op(*args)
    else:
        build_tree_kernel_efficient_torch(*args)


def verify_tree_greedy(predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor,
                       candidates: torch.Tensor, retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
                       retrive_next_sibling: torch.Tensor, target_predict: torch.Tensor) -> None:
    """sgl_kernel.verify_tree_greedy (module docstring): the Triton kernel where Triton runs, else the twin."""
    _check_verify(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                  retrive_next_sibling, target_predict)
    args = (predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
            retrive_next_sibling, target_predict)
    if use_triton(candidates):
        _verify_op(*args)
    else:
        verify_tree_greedy_torch(*args)
