"""sglang's Gemma 4 assistant centroid head with graphcap's kernel for its costly half, and, inside graphcap's captured
loop, the greedy pick straight from the head's candidates.

sglang's `Gemma4AssistantForCausalLM._apply_centroid_masking` picks each row's top clusters, copies those clusters'
LM-head rows into a [rows, k * T, H] tensor, multiplies, and scatters the products into a full-vocabulary row. At the
Gemma 4 assistant's shapes (2048 clusters of 128 tokens, top 32, hidden 1536) the copy is 12.6 MB per row per step,
written and read again: in sglang's engine it was the draft's second-largest cost at batch 64 (about 1.06 ms of
8.0 per draft call). `centroid_masking` is the same function with the copy and product replaced by
`graphcap.kernels.head.centroid.centroid_logits`, which reads each chosen row once in place, and the clusters chosen
by graphcap's one-kernel top-k (`graphcap.kernels.head.small_topk`: torch.topk's clusters, a tie taking the smaller
index); the scatter and the mask value stay sglang's, so the output is the same full-vocabulary tensor.

graphcap's loop takes a greedy token from that row, and the row is a fill of the whole vocabulary (262144 entries),
a scatter of the k * T candidates and a max over the whole vocabulary again: in sglang's engine at batch 64 about
120 us of kernels per draft call (three steps) for 4096 live entries per row. In the loop's own forward
batches (marked `CANDIDATES_MARK`) the head returns the candidates instead (`HeadCandidates`: their logits and
clusters, no full row), and `greedy_token` picks from them in one kernel
(`graphcap.kernels.head.candidate_pick.candidate_greedy`, which looks up only the tied candidates' token ids): the same
token and logit as the max over the full row, whose other entries all hold the mask value (sglang's draft extend,
which needs the full row, runs unmarked batches and is unchanged).

Numerics: each candidate's logit is its fp32 dot rounded to the weights' dtype, as the batched product's is; the
fp32 sums are taken in another order than cuBLAS's, so a logit can land one bf16 step away where its exact value
sits on a rounding boundary. A greedy pick can differ only where two top candidates are that close (sglang's own
products may move the same way between batch sizes, where cuBLAS picks other kernels; not measured here).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from graphcap.kernels.head.candidate_pick import candidate_greedy
from graphcap.kernels.head.centroid import centroid_logits
from graphcap.kernels.head.small_topk import small_topk

_INSTALLED = "_graphcap_centroid_head"
CANDIDATES_MARK = "_graphcap_head_candidates"  # on a ForwardBatch: its head returns HeadCandidates


class HeadCandidates(NamedTuple):
    """What the centroid head returns for a marked forward batch: each row's candidate logits [rows, k * T] (the
    weights' dtype; entry j * T + t the t-th token of cluster clusters[:, j]), its chosen clusters [rows, k], the
    head's token ordering [C * T] (vocabulary id of each cluster's tokens), T, and the hidden states sglang's logits
    processor would have stored."""
    values: torch.Tensor
    clusters: torch.Tensor
    token_ordering: torch.Tensor
    tokens_per_cluster: int
    hidden_states: torch.Tensor | None

    def greedy_token(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's greedy token (int64) and its logit (fp32): the largest candidate, the smallest token id on a
        tie - the max over the full-vocabulary row sglang's head builds from the same candidates."""
        return candidate_greedy(self.values, self.clusters, self.token_ordering, self.tokens_per_cluster)


def has_centroid_head(model) -> bool:
    return bool(getattr(model, "use_ordered_embeddings", False)) and getattr(model, "centroids", None) is not None


def install(model) -> bool:
    """Route this model instance's centroid masking through `centroid_masking`, and its centroid logits processor
    through `candidates_processor` (the class and other instances are untouched; the draft's other calls in the
    process - sglang's draft extend - use the masking too, and the processor's original path). False, and nothing
    changed, for a model without a centroid head."""
    if not has_centroid_head(model):
        return False
    if not getattr(model, _INSTALLED, False):
        from sglang.srt.layers.logits_processor import LogitsMetadata  # here, not in a traced call

        model._apply_centroid_masking = functools.partial(centroid_masking, model)
        model._centroid_logits_processor = functools.partial(candidates_processor, model,
                                                             model._centroid_logits_processor, LogitsMetadata)
        setattr(model, _INSTALLED, True)
    return True


def centroid_candidates(model, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's candidates as `_apply_centroid_masking` of sglang 0.5.18 and 0.5.23 (the same code) computes them:
    the logits of the top clusters' tokens [rows, k * T] (the chosen rows read in place) and those clusters
    [rows, k]."""
    flat_hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    # graphcap's one-kernel top-k (torch.topk's result; a tie ranks the smaller index first, where torch's order is
    # unspecified): torch's is a radix select and a sort per step
    _, top_k_indices = small_topk(model.centroids(flat_hidden), model.centroid_intermediate_top_k)
    weight = model.lm_head.weight
    selected_logits = centroid_logits(weight, flat_hidden, top_k_indices,
                                      model.vocab_size_per_centroid).to(weight.dtype)
    return selected_logits, top_k_indices


def centroid_masking(model, hidden_states: torch.Tensor) -> torch.Tensor:
    """`_apply_centroid_masking` of sglang 0.5.18 and 0.5.23 (same arguments, same output), the chosen rows read in
    place."""
    prefix_shape = hidden_states.shape[:-1]
    selected_logits, top_k_indices = centroid_candidates(model, hidden_states)
    centroid_vocab_indices = (model.token_ordering.long()
                              .view(model.num_centroids, model.vocab_size_per_centroid)[top_k_indices]
                              .view(selected_logits.shape[0], -1))
    mask_value = torch.finfo(selected_logits.dtype).min / 2
    output = torch.full((selected_logits.shape[0], model.vocab_size), mask_value, dtype=selected_logits.dtype,
                        device=selected_logits.device)
    output.scatter_(dim=-1, index=centroid_vocab_indices, src=selected_logits)
    return output.view(*prefix_shape, model.vocab_size)


def candidates_processor(model, original, logits_metadata, input_ids, hidden_states, projected_states, forward_batch):
    """`_centroid_logits_processor` of sglang 0.5.18 and 0.5.23 for a forward batch marked `CANDIDATES_MARK`: the same
    pruned states and stored hidden states, the head's candidates (`HeadCandidates`) in place of the full-vocabulary
    logits. Any other batch takes sglang's own processor (`original`). `logits_metadata`: sglang's LogitsMetadata
    class."""
    if not getattr(forward_batch, CANDIDATES_MARK, False):
        return original(input_ids, hidden_states, projected_states, forward_batch)
    meta = logits_metadata.from_forward_batch(forward_batch)
    proc = model.logits_processor
    pruned, pruned_before_norm, aux_pruned, sample_indices, *_ = proc._get_pruned_states(
        hidden_states, projected_states, None, meta)
    stored = proc._get_hidden_states_to_store(hidden_states, projected_states, None, pruned, pruned_before_norm,
                                              aux_pruned, sample_indices, meta)
    values, clusters = centroid_candidates(model, pruned)
    if sample_indices is not None:
        values, clusters = values[sample_indices], clusters[sample_indices]
    return HeadCandidates(values, clusters, model.token_ordering.long(), model.vocab_size_per_centroid, stored)
