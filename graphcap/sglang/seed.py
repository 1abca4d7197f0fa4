"""A joining request's draft seed: the target's hidden state at its last prompt token, gathered without a host sync.

sglang's `FrozenKVMTPDraftWorker._select_last_extend_hidden` (0.5.18 and 0.5.23, `frozen_kv_mtp_utils.
select_last_extend_hidden`) builds the gather's index with `torch.tensor(batch.extend_lens, device=...)`: a copy from
pageable host memory, which returns only once the GPU has run everything queued before it - the target's whole
prefill. A server's scheduler thread waits there on every prefill batch, and the overlap scheduler cannot queue
the next decode round behind the prefill (its cost in a server: docs/results.md, "One prefill per gap"). Here the
index is summed on the host (the lengths are host ints already) and copied from pinned memory without blocking: the
same rows, gathered by the same kind of indexing, with no wait.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch


def last_extend_hidden(extend_lens: Sequence[int], batch_size: int, hidden_states: torch.Tensor) -> torch.Tensor:
    """Row `sum(extend_lens[:i + 1]) - 1` of `hidden_states` for each request i, as sglang's function returns it
    (`hidden_states` itself where it holds one row per request already). No host sync on CUDA."""
    if hidden_states.shape[0] == batch_size:
        return hidden_states
    ends = list(itertools.accumulate(int(n) for n in extend_lens))
    if ends and ends[-1] > hidden_states.shape[0]:  # sglang's gather would fault on the device
        raise ValueError(f"graphcap seed: extend_lens {list(extend_lens)} sum to {ends[-1]}, past the "
                         f"{hidden_states.shape[0]} rows of the prefill's hidden states")
    index = torch.tensor([e - 1 for e in ends], dtype=torch.int64, pin_memory=hidden_states.is_cuda)
    return hidden_states[index.to(hidden_states.device, non_blocking=True)]
