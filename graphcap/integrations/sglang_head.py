"""sglang's Gemma 4 assistant centroid head with graphcap's kernel for its costly half.

sglang's `Gemma4AssistantForCausalLM._apply_centroid_masking` picks each row's top clusters, copies those clusters'
LM-head rows into a [rows, k * T, H] tensor, multiplies, and scatters the products into a full-vocabulary row. At the
Gemma 4 assistant's shapes (2048 clusters of 128 tokens, top 32, hidden 1536) the copy is 12.6 MB per row per step,
written and read again: in sglang's engine it was the draft's second-largest cost at batch 64 (about 1.06 ms of
8.0 per draft call). `centroid_masking` is the same function with the copy and product replaced by
`graphcap.kernels.centroid_head.centroid_logits`, which reads each chosen row once in place; the cluster choice, the
scatter and the mask value stay sglang's, so the output is the same full-vocabulary tensor.

Numerics: each candidate's logit is its fp32 dot rounded to the weights' dtype, as the batched product's is; the
fp32 sums are taken in another order than cuBLAS's, so a logit can land one bf16 step away where its exact value
sits on a rounding boundary. A greedy pick can differ only where two top candidates are that close (sglang's own
products may move the same way between batch sizes, where cuBLAS picks other kernels; not measured here).
"""
from __future__ import annotations

import functools

import torch

from graphcap.kernels.centroid_head import centroid_logits

_INSTALLED = "_graphcap_centroid_head"


def has_centroid_head(model) -> bool:
    return bool(getattr(model, "use_ordered_embeddings", False)) and getattr(model, "centroids", None) is not None


def install(model) -> bool:
    """Route this model instance's centroid masking through `centroid_masking` (the class and other instances are
    untouched; the draft's other calls in the process - sglang's draft extend - use it too). False, and nothing
    changed, for a model without a centroid head."""
    if not has_centroid_head(model):
        return False
    if not getattr(model, _INSTALLED, False):
        model._apply_centroid_masking = functools.partial(centroid_masking, model)
        setattr(model, _INSTALLED, True)
    return True


def centroid_masking(model, hidden_states: torch.Tensor) -> torch.Tensor:
    """`_apply_centroid_masking` of sglang 0.5.23 (same arguments, same output), the chosen rows read in place."""
    prefix_shape = hidden_states.shape[:-1]
    flat_hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    num_tokens = flat_hidden.shape[0]
    _, top_k_indices = torch.topk(model.centroids(flat_hidden), k=model.centroid_intermediate_top_k, dim=-1)
    weight = model.lm_head.weight
    selected_logits = centroid_logits(weight, flat_hidden, top_k_indices,
                                      model.vocab_size_per_centroid).to(weight.dtype)
    centroid_vocab_indices = (model.token_ordering.long()
                              .view(model.num_centroids, model.vocab_size_per_centroid)[top_k_indices]
                              .view(num_tokens, -1))
    mask_value = torch.finfo(selected_logits.dtype).min / 2
    output = torch.full((num_tokens, model.vocab_size), mask_value, dtype=selected_logits.dtype,
                        device=selected_logits.device)
    output.scatter_(dim=-1, index=centroid_vocab_indices, src=selected_logits)
    return output.view(*prefix_shape, model.vocab_size)
