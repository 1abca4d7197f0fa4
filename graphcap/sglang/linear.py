"""sglang's draft model with graphcap's skinny GEMM for its projections at the draft's batch sizes.

sglang's unquantized linear layers run `F.linear` (cuBLAS). At the draft's one to eight rows a projection is a
weight read, and cuBLAS reads the Gemma 4 assistant's weights at about half of copy bandwidth, plus a split-K
reduction kernel per call, plus (the MLP) a separate gelu-mul kernel that reads the [rows, 2I] product back
(docs/results.md, the skinny GEMM by shape class). `install(model)` routes one model instance's projections through
graphcap's skinny GEMM where graphcap's own draft iteration measured it faster (`gemm.skinny.kernel_rows`: up to 8
rows), and everything else through sglang's own code:
- each unquantized linear layer without a bias: its quant method's `apply` (one method object per layer in sglang
  0.5.18 and 0.5.23) is shadowed on that method object by one that sends a 2-D call of at most `kernel_rows(N)` rows
  to `skinny_linear` and any other call to sglang's `apply`; the class, its other instances and `isinstance` checks
  are untouched;
- each Gemma 3/4 MLP (gate/up, gelu-tanh * up, down): gate/up and the activation as one `skinny_gate_up_gelu` kernel
  (no [rows, 2I] intermediate), then sglang's down projection;
- the qkv projection of an attention whose K and V come from another layer's cache (every layer of the Gemma 4
  assistant, a frozen-KV draft): sglang computes K and V there and drops them, so the kernel reads only the query's
  rows of the weight - half of a sliding layer's qkv weight at the 31B assistant's shapes, four fifths of the full
  layer's - and leaves the output's K and V columns unwritten (nothing reads them).
The routing is decided in Python on static shapes, so a captured graph holds one kernel per projection and a replay
runs no routing. Nothing is installed where sglang sends bf16 GEMMs elsewhere on purpose: its batch-invariant
(deterministic) mode, a bf16 GEMM backend other than `auto`, AMX or aiter weights.

Numerics: fp32 accumulation as cuBLAS, summed in another order, so an output can land one rounding step away where
its exact value sits on a boundary; the fused MLP applies gelu-mul to the fp32 product and rounds once, where sglang
rounds the product to bf16 first. Draft tokens can therefore differ from stock sglang's where two candidates are
that close; the target's verify decides what is emitted, so outputs do not depend on it.
"""
from __future__ import annotations

import torch

from graphcap.kernels import use_triton
from graphcap.kernels.gemm.skinny import DTYPES, accepts, kernel_rows, skinny_gate_up_gelu, skinny_linear
from graphcap.kernels.gemm.skinny_kernels import prepare_fixup

_MARK = "_graphcap_skinny"  # on a routed apply / MLP forward: what its owner held there before (restore)
_ABSENT = object()  # ... nothing of its own (the class's method)


def sglang_routes_bf16_elsewhere() -> str | None:
    """Why sglang's own bf16 GEMM choice must stand in this process (its reason, named), else None."""
    try:
        from sglang.srt.batch_invariant_ops import is_batch_invariant_mode_enabled
        from sglang.srt.layers.quantization import unquant

        if is_batch_invariant_mode_enabled():
            return "sglang's batch-invariant (deterministic) mode is on"
        backend = unquant.get_bf16_gemm_backend()
        if not backend.is_auto():
            return f"sglang's bf16 GEMM backend is {backend.value}"
        if getattr(unquant, "_use_aiter", False):
            return "sglang runs its GEMMs through aiter"
    except (ImportError, AttributeError) as e:  # a layout neither 0.5.18 nor 0.5.23 has: leave its GEMMs alone
        return f"sglang's bf16 GEMM routing could not be read ({type(e).__name__}: {e})"
    return None


def fits(x: torch.Tensor, w: torch.Tensor, rows: int, gated: bool = False) -> bool:
    """A call routed to the kernel: 1..rows rows that the skinny GEMM's ops take as they are (`gemm.skinny.accepts`),
    on a device where Triton runs (elsewhere sglang's own path, exactly as without graphcap)."""
    return x.ndim == 2 and 1 <= x.shape[0] <= rows and accepts(x, w, gated) and use_triton(x)


def _routable(layer) -> bool:
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
    from sglang.srt.utils import use_intel_amx_backend

    w = getattr(layer, "weight", None)
    return (isinstance(getattr(layer, "quant_method", None), UnquantizedLinearMethod) and getattr(layer, "bias", None)
            is None and isinstance(w, torch.Tensor) and w.ndim == 2 and w.dtype in DTYPES
            and not use_intel_amx_backend(layer))


def _shadow(obj, name: str, fn) -> None:
    """Set `fn` as `obj`'s own attribute `name`, remembering what `obj` itself held there (restore puts it back)."""
    setattr(fn, _MARK, vars(obj).get(name, _ABSENT))
    setattr(obj, name, fn)


def _shadowed(obj, name: str) -> bool:
    return hasattr(vars(obj).get(name), _MARK)


def drops_kv(attn) -> bool:
    """Whether sglang's attention forward drops the K and V of its qkv projection: a KV-shared layer, the condition
    its `Gemma4Attention.forward` tests (0.5.18 and 0.5.23) before it sets k and v to None."""
    return bool(getattr(attn, "is_kv_shared_layer", False)) and getattr(attn, "kv_shared_layer_index", None) is not None


def _kv_sharing_attentions(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """id(qkv_proj) -> its attention, for the attentions that can share another layer's K/V (Gemma 4's: a qkv
    projection laid out as [q | k | v] rows, its sizes per rank, and the KV-sharing attributes)."""
    out = {}
    for m in model.modules():
        qkv = getattr(m, "qkv_proj", None)
        q, kv = getattr(m, "q_size", None), getattr(m, "kv_size", None)
        if (hasattr(m, "is_kv_shared_layer") and isinstance(q, int) and isinstance(kv, int)
                and isinstance(getattr(qkv, "weight", None), torch.Tensor) and qkv.weight.shape[0] == q + 2 * kv):
            out[id(qkv)] = m
    return out


def _route_linear(layer, attn: torch.nn.Module | None = None) -> None:
    """Shadow `layer`'s apply; `attn`: the attention owning it as its qkv projection, whose K/V it may drop."""
    original = layer.quant_method.apply  # bound (or sglang's debug wrapper of it)
    rows = kernel_rows(layer.weight.shape[0])
    q_size = attn.q_size if attn is not None else 0
    q_rows = kernel_rows(q_size) if attn is not None else 0

    def apply(lay, x, bias=None):
        if lay is layer and bias is None:
            w = layer.weight
            if attn is not None and drops_kv(attn) and fits(x, w[:q_size], q_rows):
                # decided per call (the KV-sharing is bound after load); the unwritten K/V columns are never read
                out = x.new_empty((x.shape[0], w.shape[0]))
                skinny_linear(x, w[:q_size], out=out[:, :q_size])
                return out
            if fits(x, w, rows):
                return skinny_linear(x, w)
        return original(lay, x, bias)

    _shadow(layer.quant_method, "apply", apply)  # this layer's method object alone (sglang makes one per layer)


def _is_gelu_tanh_mlp(module) -> bool:
    from sglang.srt.layers.activation import GeluAndMul
    from sglang.srt.layers.linear import MergedColumnParallelLinear

    gate_up = getattr(module, "gate_up_proj", None)
    return (isinstance(gate_up, MergedColumnParallelLinear) and not gate_up.gather_output
            and hasattr(module, "down_proj") and isinstance(getattr(module, "act_fn", None), GeluAndMul)
            and module.act_fn.approximate == "tanh" and gate_up.weight.shape[0] % 2 == 0)


def _route_mlp(mlp) -> None:
    original = mlp.forward
    gate_up = mlp.gate_up_proj
    rows = kernel_rows(gate_up.weight.shape[0] // 2, gated=True)

    def forward(x):
        if fits(x, gate_up.weight, rows, gated=True):  # gate/up and gelu-tanh * up in one kernel ([2I, K] stacked)
            out, _ = mlp.down_proj(skinny_gate_up_gelu(x, gate_up.weight))
            return out
        return original(x)

    _shadow(mlp, "forward", forward)


def install(model: torch.nn.Module) -> int:
    """Route `model`'s projections through graphcap's skinny GEMM (see the module's docstring); returns the number
    of linear layers routed - 0, and nothing changed, where `sglang_routes_bf16_elsewhere` gives a reason.
    Idempotent. Call it before capture: it also makes the split-K arrival counters of the kernel's one-kernel split
    K, which must not come from a graph's private pool (`gemm.skinny_kernels.prepare_fixup`)."""
    if sglang_routes_bf16_elsewhere() is not None:
        return 0
    routed = 0
    owners = _kv_sharing_attentions(model)
    for module in model.modules():
        if _routable(module):
            if not _shadowed(module.quant_method, "apply"):
                _route_linear(module, owners.get(id(module)))
            if module.weight.is_cuda:
                prepare_fixup(module.weight.device)
            routed += 1
    for module in model.modules():
        if _is_gelu_tanh_mlp(module) and _shadowed(module.gate_up_proj.quant_method, "apply") \
                and not _shadowed(module, "forward"):
            _route_mlp(module)
    return routed


def restore(model: torch.nn.Module) -> None:
    """Undo `install` on `model`: sglang's own methods, as they were, again."""
    for module in model.modules():
        for obj, name in ((module, "forward"), (getattr(module, "quant_method", None), "apply")):
            if obj is not None and _shadowed(obj, name):
                prev = getattr(vars(obj)[name], _MARK)
                if prev is _ABSENT:
                    delattr(obj, name)
                else:
                    setattr(obj, name, prev)
