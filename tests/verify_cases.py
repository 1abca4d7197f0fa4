"""Random verify-attention inputs shared by the kernel's tests (test_verify_attention.py) and the sglang seat's
(sglang_isolated/check_verify_seat.py)."""
from __future__ import annotations

import torch


def make_case(batch, n_q, hkv, group, d, lens, pool, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    h = hkv * group
    t = batch * n_q

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    locs = torch.randperm(pool, generator=g)[:sum(lens)].to(device)  # scattered locations, never contiguous runs
    indptr = torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32,
                          device=device)
    return dict(q=r(t, h, d), k_new=r(t, hkv, d), v_new=r(t, hkv, d), k_pool=r(pool, hkv, d), v_pool=r(pool, hkv, d),
                indptr=indptr, indices=locs)


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def chain_mask(lens, n_q):
    """A topk-1 verify's tree mask as sglang builds it (every prefix key; causal among the n_q new tokens), rows of
    prefix + n_q entries per request, and its per-request offsets: (uint8 mask, int64 mask_indptr), on the CPU."""
    masks, mptr = [], [0]
    for n in lens:
        m = torch.ones(n_q, n + n_q, dtype=torch.bool)
        m[:, n:] = torch.tril(torch.ones(n_q, n_q, dtype=torch.bool))
        masks.append(m.flatten())
        mptr.append(mptr[-1] + m.numel())
    return torch.cat(masks).to(torch.uint8), torch.tensor(mptr, dtype=torch.int64)
