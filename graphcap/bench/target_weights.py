"""The user-scale target's weights loaded into a running sglang - an in-process `sglang.Engine` or a server started
as users start it (`--load-format dummy`) - over sglang's own weight-update API: the checkpoint's structure
(embeddings, lm_head, norms, layer scalars: `load_target_structure`) and, for the user's INT8 W8A8 target, seeded
int8 projections in every linear layer (`load_target_w8a8`). Both go to the target runner alone (selector "target"),
in one begin/end weight update each (`update_target`), through a `WeightUpdates`: `EngineUpdates` (the engine's
tokenizer manager, in process) or `HttpUpdates` (the server's /begin_weight_update, /update_weights_from_tensor and
/end_weight_update, the tensors passed as sglang's own client passes them: CUDA IPC handles in a ForkingPickler
payload, base64 in JSON). Pure but for those calls: tested on CPU against sglang's own model and request classes."""
from __future__ import annotations

import base64
import glob
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

INT8_STD = math.sqrt((255**2 - 1) / 12)  # std of an int8 drawn uniformly from [-127, 127]
Named = list  # [(name, tensor)]: one update's tensors


class WeightUpdates(Protocol):
    """sglang's weight-update calls on the target runner alone, each answering (ok, message)."""

    def begin(self) -> tuple[bool, str]: ...

    def send(self, named: Named, load_format: str | None) -> tuple[bool, str]: ...

    def end(self) -> tuple[bool, str]: ...


class EngineUpdates:
    """Through an in-process `sglang.Engine`: its begin/end calls, and `update_weights_from_tensor` built as the
    engine builds it but with selector "target" (the field `Engine.update_weights_from_tensor` does not expose).
    `request_cls`: sglang's UpdateWeightsFromTensorReqInput (tests pass a stand-in)."""

    def __init__(self, engine, request_cls=None) -> None:
        if request_cls is None:
            from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput as request_cls
        self.engine, self.request_cls = engine, request_cls

    def begin(self) -> tuple[bool, str]:
        ok, msg = self.engine.begin_weight_update(selector="target")[:2]
        return bool(ok), str(msg)

    def send(self, named: Named, load_format: str | None) -> tuple[bool, str]:
        e = self.engine
        req = self.request_cls(serialized_named_tensors=e._serialize_tensors_per_rank(named, load_format),
                               load_format=load_format, flush_cache=True, selector="target")
        ok, msg = e.loop.run_until_complete(e.tokenizer_manager.update_weights_from_tensor(req, None))[:2]
        return bool(ok), str(msg)

    def end(self) -> tuple[bool, str]:
        ok, msg = self.engine.end_weight_update()[:2]
        return bool(ok), str(msg)


def serialize_named(named: Named) -> str:
    """One rank's payload as sglang's HTTP API takes it: the ForkingPickler bytes sglang's MultiprocessingSerializer
    writes (CUDA tensors as IPC handles, CPU tensors as shared-memory files), base64 in a JSON string. With CUDA
    tensors, torch's reduction patched as sglang's own clients patch it (the device named by its UUID, which the
    server maps to its own index)."""
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # its import registers torch's tensor reductions with ForkingPickler

    if any(t.is_cuda for _, t in named):
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()
    # CPU tensors by shared-memory file name: a file descriptor passes only to a process of this one's
    # multiprocessing tree (its authkey), and a server is not one
    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        buf = io.BytesIO()
        ForkingPickler(buf).dump(named)
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)
    return base64.b64encode(buf.getvalue()).decode("ascii")


class HttpUpdates:
    """Through a running server's HTTP API at `url` (a client on the server's machine: the tensors stay in this
    process and sglang's scheduler maps them). `tp_size`: one payload per tensor-parallel rank, as sglang's engine
    sends them."""

    def __init__(self, url: str, tp_size: int = 1, timeout_s: float = 600.0) -> None:
        self.url, self.tp_size, self.timeout_s = url.rstrip("/"), tp_size, timeout_s

    def _post(self, path: str, payload: dict) -> tuple[bool, str]:
        from graphcap.bench.server import http_json

        status, body = http_json(self.url + path, payload, timeout=self.timeout_s)
        if isinstance(body, dict) and "success" in body:
            return bool(body["success"]) and status == 200, str(body.get("message", ""))
        return False, f"{path}: HTTP {status or 'no answer'}: {str(body)[:300]}"

    def begin(self) -> tuple[bool, str]:
        return self._post("/begin_weight_update", {"selector": "target"})

    def send(self, named: Named, load_format: str | None) -> tuple[bool, str]:
        payload = serialize_named(named)
        return self._post("/update_weights_from_tensor",
                          {"serialized_named_tensors": [payload] * self.tp_size, "load_format": load_format,
                           "flush_cache": True, "selector": "target"})

    def end(self) -> tuple[bool, str]:
        return self._post("/end_weight_update", {})


def structure_files(target: str) -> list[str]:
    """The target checkpoint's safetensors files (sglang_checkpoint.py writes the structure alone at this size)."""
    files = sorted(glob.glob(os.path.join(target, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {target}")
    return files


def structure_batches(target: str, device: str, batch_bytes: int | None = None) -> Iterator[Named]:
    """(name, tensor) of every tensor in the target checkpoint, as sglang's loader reads them from disk, in batches
    of at most `batch_bytes` (a larger tensor alone; None: one batch), each read when its turn comes: a client beside
    a server holds one batch on the GPU at a time."""
    from safetensors import safe_open

    batch, size = [], 0
    for f in structure_files(target):
        with safe_open(f, framework="pt", device=device) as st:
            for name in st.keys():
                t = st.get_tensor(name)
                n = t.numel() * t.element_size()
                if batch and batch_bytes is not None and size + n > batch_bytes:
                    yield batch
                    batch, size = [], 0
                batch.append((name, t))
                size += n
    if batch:
        yield batch


def update_target(updates: WeightUpdates, batches: Iterable[tuple[Named, str | None]]) -> tuple[bool, str, int]:
    """One weight update on the target runner alone, not the draft runner: begin (selector "target"), then for each
    batch of (name, tensor) one update with its load format, then end (also after a failed update; sglang refuses
    updates outside a begin/end pair). The tensors change in place (the captured graphs keep their addresses).
    `batches` may be a generator: a batch is built when its turn comes, and this loop holds no reference to it once
    its update is answered. Returns (ok, message, batches loaded)."""
    ok, msg = updates.begin()
    if not ok:
        return False, f"begin_weight_update: {msg}", 0
    done = 0
    try:
        for named, load_format in batches:
            ok, msg = updates.send(named, load_format)
            del named  # the generator's reference is then the last: it frees the batch before building the next
            if not ok:
                msg = f"batch {done}: {msg}"
                break
            done += 1
    finally:
        end_ok, end_msg = updates.end()
    if ok and not end_ok:
        ok, msg = False, f"end_weight_update: {end_msg}"
    return bool(ok), str(msg), done


def load_target_structure(updates: WeightUpdates, target: str, device: str = "cuda",
                          batch_bytes: int | None = None) -> dict:
    """Load the target checkpoint's structure over the target runner's dummy weights with sglang's own loader
    (the model's load_weights: load_format None), in one weight update of `update_target`: one update per batch of
    `structure_batches` (its tensors are embeddings, norms and scalars: none is loaded in parts)."""
    structure_files(target)  # a missing checkpoint is named before the weight update begins
    sent = {"tensors": 0, "bytes": 0}

    def batches() -> Iterator[tuple[Named, None]]:
        for named in structure_batches(target, device, batch_bytes):
            sent["tensors"] += len(named)
            sent["bytes"] += sum(t.numel() * t.element_size() for _, t in named)
            yield named, None
            del named
            _release(device)

    ok, msg, done = update_target(updates, batches())
    _release(device)  # also the batch a failed update left
    return {**sent, "batches": done, "ok": ok, "message": msg}


def _release(device: str) -> None:
    """Give the GPU memory of sent batches back to the driver. A batch sent through CUDA IPC stays mapped until the
    receiver has dropped it and this process collects; torch's caching allocator then still holds it unless
    emptied. This process hosts sglang's Engine, whose scheduler sized its pools at start-up: what stays reserved
    here (GiBs after the W8A8 target's layers and the embeddings) comes out of the scheduler's activation headroom,
    where a long prefill runs out of memory."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()


# the W8A8 target's int8 projections


@dataclass(frozen=True)
class Int8Projection:
    """One W8A8 linear layer of the target as sglang's model holds it: `name` the module (sglang's fused modules:
    qkv_proj = q;k;v, gate_up_proj = gate;up), `n` output channels, `k` input features. Its parameters:
    `{name}.weight` int8, created [n, k] and held as its transpose, a [k, n] column-major view, after the
    scheme's process_weights_after_loading; `{name}.weight_scale` fp32 [n, 1] (compressed-tensors W8A8 int8,
    channel strategy)."""

    name: str
    n: int
    k: int


def target_projections(config: dict) -> list[tuple[Int8Projection, ...]]:
    """Per layer of a target config.json (sglang_checkpoint.configs' keys, which sglang's Gemma4Attention reads: the
    sliding layers' heads from swa_*, the full layers' from num_key_value_heads / head_dim), its four quantized
    projections: qkv_proj, o_proj, gate_up_proj, down_proj."""
    if config.get("attention_k_eq_v"):
        raise ValueError("target config: attention_k_eq_v is set (its full layers' v is its k, which load_target_w8a8 "
                         "does not build); sglang_checkpoint.py writes the target with attention_k_eq_v false")
    hidden, ffn, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    layers = []
    for i, kind in enumerate(config["layer_types"]):
        if kind == "sliding_attention":
            q_heads = config.get("swa_num_attention_heads", heads)
            kv = config.get("swa_num_key_value_heads", config["num_key_value_heads"])
            hd = config.get("swa_head_dim", config["head_dim"])
        elif kind == "full_attention":
            q_heads, kv, hd = heads, config["num_key_value_heads"], config["head_dim"]
        else:
            raise ValueError(f"target config: layer {i} has layer type {kind!r}, not sliding_attention or "
                             "full_attention")
        p = f"model.layers.{i}"
        layers.append((Int8Projection(f"{p}.self_attn.qkv_proj", (q_heads + 2 * kv) * hd, hidden),
                       Int8Projection(f"{p}.self_attn.o_proj", hidden, q_heads * hd),
                       Int8Projection(f"{p}.mlp.gate_up_proj", 2 * ffn, hidden),
                       Int8Projection(f"{p}.mlp.down_proj", hidden, ffn)))
    return layers


def int8_specs(proj: Int8Projection) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of the tensors `int8_projection` makes: sglang's parameters as the W8A8 int8 scheme holds
    them once loaded (the weight [k, n], the transpose of the checkpoint's [n, k]; the scale [n, 1])."""
    import torch

    return [(f"{proj.name}.weight", (proj.k, proj.n), torch.int8),
            (f"{proj.name}.weight_scale", (proj.n, 1), torch.float32)]


def int8_projection(proj: Int8Projection, seed: int, device: str = "cuda") -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of one projection as load_format="direct" copies them into sglang's parameters: the weight
    [k, n] int8 (the layout sglang holds it in; the checkpoint's [n, k] weight is its transpose), uniform in
    [-127, 127], and weight_scale [n, 1] fp32, positive, spread over 0.5-1.5x per output channel (a misplaced scale
    changes the output) and scaled so the dequantized weight's RMS is 1 / sqrt(k), the scale of the bf16 checkpoints'
    random projections (sglang_checkpoint._layers). Deterministic in `seed` on a given device type."""
    import torch

    (w_name, w_shape, w_dtype), (s_name, s_shape, s_dtype) = int8_specs(proj)
    g = torch.Generator(device=device).manual_seed(seed)
    weight = torch.randint(-127, 128, w_shape, generator=g, dtype=w_dtype, device=device)
    spread = torch.rand(s_shape, generator=g, dtype=s_dtype, device=device) + 0.5
    scale = spread / spread.pow(2).mean().sqrt() / (math.sqrt(proj.k) * INT8_STD)
    return [(w_name, weight), (s_name, scale)]


def int8_layer(projs: tuple[Int8Projection, ...], layer: int, seed: int, device: str = "cuda"
               ) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every projection of layer `layer`, each from a seed of its own (`seed`, the layer, the
    projection): what one direct load sends."""
    return [t for j, p in enumerate(projs) for t in int8_projection(p, seed * 1_000_003 + 4 * layer + j, device)]


def load_target_w8a8(updates: WeightUpdates, config: dict, device: str = "cuda", seed: int = 0) -> dict:
    """Load int8 projections (`int8_layer`, seeded per layer and projection) into every W8A8 linear layer of the target
    runner, one `update_weights_from_tensor` per layer with load_format "direct" (sglang copies each tensor into the
    parameter of its name: its model's load_weights would not, as the transposed int8 weight has no weight_loader), in
    one weight update of `update_target`; a layer's tensors are freed before the next one's are built.

    The structure's weight update (`load_target_structure`) must follow: sglang ends every weight update with each
    quantized layer's process_weights_after_loading, and the W8A8 int8 scheme's transposes the weight again, while its
    restore_weights_before_loading (run at a weight update's begin) is sglang's no-op. The engine starts with each
    weight as a [k, n] view (what this weight update loads into), this weight update's end leaves an [n, k] one, the
    next weight update's end a [k, n] one again: the layout sglang's int8 GEMM takes."""
    layers = target_projections(config)
    sent = {"tensors": 0, "bytes": 0}

    def batches() -> Iterator[tuple[list, str]]:
        for i, projs in enumerate(layers):
            named = int8_layer(projs, i, seed, device)
            sent["tensors"] += len(named)
            sent["bytes"] += sum(t.numel() * t.element_size() for _, t in named)
            yield named, "direct"
            del named  # sglang's process has copied the layer: free it
            _release(device)

    ok, msg, done = update_target(updates, batches())
    _release(device)  # also the layer a failed update left
    return {"layers": len(layers), "layers_loaded": done, **sent, "load_format": "direct", "seed": seed, "ok": ok,
            "message": msg}


def checkpoint_weights(config: dict) -> str:
    """"w8a8" where a target config.json declares compressed-tensors int8 weights (sglang_checkpoint.py --weights
    w8a8), else "bf16"."""
    q = config.get("quantization_config") or {}
    if q.get("quant_method") != "compressed-tensors":
        return "bf16"
    groups = (q.get("config_groups") or {}).values()
    return "w8a8" if any((g.get("weights") or {}).get("type") == "int" for g in groups) else "bf16"
