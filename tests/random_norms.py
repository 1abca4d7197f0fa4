"""A tiny-spec target state and draft model whose norm weights and layer scalars are random (not the model's initial
0 and 1), for tests that compare op sets: every (1 + w), residual and scalar then matters."""
from __future__ import annotations

import torch

from graphcap.bench.state import TargetState, make_target_state
from graphcap.models import FrozenKVDraft
from graphcap.spec import CaptureSpec, load_spec


def random_norm_draft(device: str, lens: list[int], seed: int = 6) -> tuple[CaptureSpec, TargetState, FrozenKVDraft]:
    """(the float32 tiny spec, a target state with `lens` tokens per request and room for 20 more, its draft model)."""
    spec = load_spec("tiny")
    assert spec.torch_dtype() == torch.float32
    st = make_target_state(spec, lens, [n + 20 for n in lens], seed=seed, device=device)
    model = FrozenKVDraft(spec, seed=seed + 1, device=device)
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
        for layer in model.layers:
            layer.layer_scalar.fill_(0.5 + torch.rand((), generator=g).item())
    return spec, st, model
