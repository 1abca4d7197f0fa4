"""The W8A8 target's weights as graphcap.bench.target_weights loads them (bench/sglang_user_scale.py in process,
bench/sglang_server.py over HTTP) against sglang's own model, request classes and weight updater (0.5.23, CPU): what
the first GPU run of `--weights w8a8` would otherwise find out. Beside it, the server harness's other request of its
own making (the logit margin's /generate) built into sglang's GenerateReqInput.

- At the user's scale (the 60-layer config bench/sglang_checkpoint.py writes with --weights w8a8, sglang's model built
  on the meta device with the quantization sglang reads from that config): the harness's int8 tensors carry the
  names, shapes and dtypes of sglang's own parameters, in the layout the W8A8 int8 scheme holds after loading, and
  with the checkpoint's structure they cover every parameter of the model (none left at the dummy init).
- On the tiny pair, with real tensors: sglang's dummy loader builds the target, then the harness's two weight updates
  run through sglang's own SchedulerWeightUpdaterManager and the model runner's WeightUpdater (the scheduler's side of
  Engine.update_weights_from_tensor; only the hop from the engine's process to the scheduler's is left out): the int8
  projections (load_format "direct") and the structure land where the harness meant them, and each layer's forward -
  sglang's own, with the stand-in's int8_scaled_mm as its GEMM - computes x W^T. After the int8 weight update alone the
  weights are transposed (sglang's end of a weight update runs the scheme's process_weights_after_loading again): the
  structure's weight update must follow, as the harness requires. Over HTTP (each JSON body built into sglang's own
  request class, the payloads deserialized by sglang's MultiprocessingSerializer) the same weights land.

Run in a fresh interpreter (it initialises torch.distributed), as tests/sglang/test_runtime.py does:
    pytest -o python_files='check_*.py' -o addopts= <this file>"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("sglang", reason="the real sglang package is not installed")
sys.path[:0] = [str(ROOT / "tests" / "sglang_isolated"), str(ROOT / "tests")]
from _sglang_env import install_torchvision_stub, install_vllm_rope_stub  # noqa: E402
from bench_scripts import load_bench_script, load_file  # noqa: E402

from graphcap.bench import target_weights as tw  # noqa: E402

install_torchvision_stub()
install_vllm_rope_stub()

ck = load_bench_script("sglang_checkpoint")
SM90 = (9, 0)  # the capability compressed-tensors' scheme check reads (an H200's; the scheme needs 80)


@contextlib.contextmanager
def cuda_capability(cap: tuple[int, int]):
    """torch.cuda.get_device_capability answering `cap` on this CPU machine, for compressed-tensors' scheme check."""
    saved = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda *a, **k: cap
    try:
        yield
    finally:
        torch.cuda.get_device_capability = saved


@pytest.fixture(scope="module")
def runtime():
    """sglang's process state for building a model on CPU: torch.distributed (gloo, one rank), the published server
    arguments, sglang's parallel groups. Another check of this interpreter may have started them, and a reset of
    sglang's context since then forgets the groups: they are built afresh."""
    from sglang.srt import runtime_context
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import (destroy_model_parallel, init_distributed_environment,
                                                       initialize_model_parallel, model_parallel_is_initialized)
    from sglang.srt.runtime_context import get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(29000 + os.getpid() % 2000)), ("RANK", "0"),
                 ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")  # once per process
    if model_parallel_is_initialized():
        destroy_model_parallel()
    reset_context()
    publish(ServerArgs(model_path="dummy", skip_tokenizer_init=True, device="cpu", load_format="dummy"), role="test",
            ranks=runtime_context.SpawnRanks(world_rank=0))
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")
    yield
    reset_context()


def model_config(target: Path):
    from sglang.srt.configs.model_config import ModelConfig

    return ModelConfig(str(target), dtype="bfloat16")


def build_meta_model(target: Path):
    """sglang's target model from `target`/config.json on the meta device, with the quantization sglang reads from
    that config, and each quantized layer's process_weights_after_loading run as sglang's loaders run it."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import _get_quantization_config, _initialize_model

    mc, lc = model_config(target), LoadConfig(load_format="dummy")
    with cuda_capability(SM90):
        qc = _get_quantization_config(mc, lc)
        saved = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("meta"):
                model = _initialize_model(mc, lc, qc)
        finally:
            torch.set_default_dtype(saved)
    for module in model.modules():
        if getattr(module, "quant_method", None) is not None:
            module.quant_method.process_weights_after_loading(module)
    return model


def structure_names(size: str) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the target structure bench/sglang_checkpoint.py writes at `size`, without building its
    embeddings (a vocabulary x hidden table)."""
    s = ck.SIZES[size]
    layers = ck._layers("model", s, s.t_hidden, s.t_ffn, s.t_types, True, torch.Generator(), "cpu", matrices=False)
    return {"model.embed_tokens.weight": (s.vocab, s.t_hidden), "lm_head.weight": (s.vocab, s.t_hidden),
            **{k: tuple(v.shape) for k, v in layers.items()}}


def test_user_scale_int8_tensors_are_sglangs_parameters(runtime, tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    config, _ = ck.configs(ck.SIZES["user-scale"], 1024, 32768, "w8a8")
    (target / "config.json").write_text(json.dumps(config))
    model = build_meta_model(target)
    params = {n: p for n, p in model.named_parameters()}
    buffers = dict(model.named_buffers())
    layers = tw.target_projections(config)
    assert len(layers) == 60
    harness = {n: (shape, dtype) for projs in layers for p in projs for n, shape, dtype in tw.int8_specs(p)}
    for name, (shape, dtype) in harness.items():
        assert name in params, f"{name}: not a parameter of sglang's model"
        p = params[name]
        assert (tuple(p.shape), p.dtype) == (shape, dtype), f"{name}: {shape} {dtype}, sglang's {p.shape} {p.dtype}"
    # every int8 parameter and every weight scale of sglang's model comes from the harness
    quantized = {n for n, p in params.items() if p.dtype == torch.int8 or n.endswith(".weight_scale")}
    assert quantized == set(harness)
    # the weights as the scheme holds them after loading: a [k, n] column-major view (what int8_scaled_mm takes)
    qkv = model.get_submodule("model.layers.0.self_attn.qkv_proj")
    assert type(qkv.scheme).__name__ == "CompressedTensorsW8A8Int8" and qkv.weight.stride() == (1, 5376)
    assert type(model.lm_head.quant_method).__name__ == "UnquantizedEmbeddingMethod"  # lm_head stays bf16
    # the structure (checkpoint) and the int8 projections (harness) load every parameter and layer scalar
    structure = structure_names("user-scale")
    loaded = set(harness) | set(structure)
    assert set(params) <= loaded, sorted(set(params) - loaded)[:10]
    for name, shape in structure.items():
        t = params.get(name, buffers.get(name))
        assert t is not None and tuple(t.shape) == shape, (name, shape)
        assert t.dtype in (torch.bfloat16, torch.float32), (name, t.dtype)


class _Engine:
    """sglang.Engine's weight-update calls as load_target_w8a8 and load_target_structure make them, each answered by
    sglang's own scheduler-side code: the weight updates and runner selection of SchedulerWeightUpdaterManager, the
    loads of the target model runner's WeightUpdater. The payloads pass as they are (one per rank; sglang's serializer
    sends CUDA tensors only). A draft runner that fails if asked stands beside the target's."""

    def __init__(self, model, mc, deserialize=None):
        from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
        from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

        def refuse(*args, **kwargs):
            raise AssertionError("the draft runner was asked to update its weights")

        updater = WeightUpdater(tp_rank=0, device="cpu", gpu_id=0, model_config=mc, custom_weight_loaders={},
                                get_model=lambda: model, update_model_fields=refuse, recapture_cuda_graph=refuse,
                                get_model_runner=refuse)
        target = types.SimpleNamespace(weight_updater=updater)
        draft = types.SimpleNamespace(weight_updater=types.SimpleNamespace(
            begin_weight_update=refuse, end_weight_update=refuse, update_weights_from_tensor=refuse))
        tp_worker = types.SimpleNamespace(weight_update_runners=lambda: [("target", target)],
                                          deserialize_own_rank=lambda payloads: (deserialize or (lambda x: x))(
                                              payloads[0]))
        self.manager = SchedulerWeightUpdaterManager(
            tp_worker=tp_worker, draft_worker=types.SimpleNamespace(weight_update_runners=lambda: [("draft", draft)]),
            memory_saver_adapter=None, flush_cache=lambda **kw: True, is_fully_idle=lambda **kw: True,
            scheduler=types.SimpleNamespace(record_weight_version_change=lambda **kw: None))
        self.loop = self.tokenizer_manager = self
        self.updates, self.mc = [], mc

    def begin_weight_update(self, selector: str = "all"):
        from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput

        out = self.manager.begin_weight_update(BeginWeightUpdateReqInput(selector=selector))
        return out.success, out.message

    def end_weight_update(self):
        from sglang.srt.managers.io_struct import EndWeightUpdateReqInput

        out = self.manager.end_weight_update(EndWeightUpdateReqInput())
        return out.success, out.message

    def _serialize_tensors_per_rank(self, tensors, load_format):
        # one payload per rank, as the engine's; the tensors themselves (sglang's serializer sends CUDA tensors only)
        assert load_format != "flattened_bucket"
        return [tensors]

    def update_weights_from_tensor(self, req, request):
        self.updates.append((req.load_format, req.selector))
        out = self.manager.update_weights_from_tensor(req)
        return out.success, out.message

    def run_until_complete(self, result):
        return result


def standin_int8_scaled_mm():
    """The stand-in's int8_scaled_mm torch twin (sgl_kernel's argument checks, then its arithmetic), loaded from its
    file: the stand-in package itself must not reach this process."""
    return load_file(ROOT / "tests" / "support" / "sgl_kernel" / "int8_gemm.py",
                     "standin_int8_gemm_check").int8_scaled_mm_torch


@pytest.fixture
def tiny_w8a8(runtime, tmp_path):
    """The tiny pair written with --weights w8a8, its target built by sglang's own dummy loader on CPU (the int8
    weights left uninitialised, the scales random, each quantized layer's process_weights_after_loading run), and an
    _Engine over it."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import DummyModelLoader

    ck.make_pair("tiny", tmp_path, device="cpu", sample=64, weights="w8a8")
    target = tmp_path / "target"
    mc = model_config(target)
    with cuda_capability(SM90):
        model = DummyModelLoader(LoadConfig(load_format="dummy")).load_model(model_config=mc,
                                                                             device_config=DeviceConfig("cpu"))
    return model, _Engine(model, mc), target, json.loads((target / "config.json").read_text())


def layer_forward(module, x: torch.Tensor, monkeypatch) -> torch.Tensor:
    """sglang's forward of a W8A8 linear layer with the stand-in's int8_scaled_mm as the GEMM (on CUDA the scheme
    binds sgl_kernel's at import) and sglang's torch twin of its per-token int8 quantization (sglang.test's
    cpu_test_utils: its Triton kernel's libdevice.round does not run in Triton's interpreter)."""
    from sglang.test.cpu_test_utils import per_token_quant_int8

    scheme = sys.modules[type(module.scheme).__module__]
    monkeypatch.setattr(scheme, "int8_scaled_mm", standin_int8_scaled_mm(), raising=False)
    monkeypatch.setattr(scheme, "per_token_quant_int8", per_token_quant_int8)
    out = module(x)
    return out[0] if isinstance(out, tuple) else out


@contextlib.contextmanager
def http_bridge(engine: _Engine):
    """A server at the yielded URL answering sglang's three weight-update routes as sglang's HTTP server does: each
    JSON body built into sglang's own request class (an unknown field is refused), the base64 payloads decoded to the
    bytes sglang's scheduler deserializes, then the scheduler-side manager's answer as {"success", "message"}."""
    import base64
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from sglang.srt.managers.io_struct import (BeginWeightUpdateReqInput, EndWeightUpdateReqInput,
                                               UpdateWeightsFromTensorReqInput)

    def answer(path: str, body: dict):
        m = engine.manager
        if path == "/begin_weight_update":
            return m.begin_weight_update(BeginWeightUpdateReqInput(**body))
        if path == "/end_weight_update":
            return m.end_weight_update(EndWeightUpdateReqInput(**body))
        if path == "/update_weights_from_tensor":
            body = {**body, "serialized_named_tensors": [base64.b64decode(x, validate=True)
                                                         for x in body["serialized_named_tensors"]]}
            req = UpdateWeightsFromTensorReqInput(**body)
            engine.updates.append((req.load_format, req.selector))
            return m.update_weights_from_tensor(req)
        raise KeyError(path)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            try:
                out = answer(self.path, body)
                status, reply = (200 if out.success else 400), {"success": out.success, "message": out.message}
            except Exception as e:  # sglang answers a bad request with its error; the test sees it in the message
                status, reply = 400, {"success": False, "message": f"{type(e).__name__}: {e}"}
            data = json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def torch_tensor_reduction():
    """torch's own tensor reduction for ForkingPickler while inside: sglang's patch of it (applied once sglang's
    modules load) rewrites a CUDA tensor's device index to its UUID and fails on the CPU tensors this run sends."""
    from torch.multiprocessing import reductions

    patched = getattr(reductions, "_reduce_tensor_original", None)
    if patched is None:
        yield
        return
    modified = reductions.reduce_tensor
    reductions.reduce_tensor = reductions._reduce_tensor_original
    reductions.init_reductions()
    try:
        yield
    finally:
        reductions.reduce_tensor = modified
        reductions.init_reductions()


@pytest.mark.parametrize("path", ["engine", "http"])
def test_int8_projections_then_structure_load_as_sglang_serves_them(tiny_w8a8, monkeypatch, path):
    """Both routes - the in-process engine's calls and a server's HTTP API (the payloads serialized as sglang's
    client serializes them, deserialized by sglang's own MultiprocessingSerializer) - load the same weights."""
    model, engine, target, config = tiny_w8a8
    with contextlib.ExitStack() as stack:
        if path == "http":
            from sglang.srt.utils import MultiprocessingSerializer

            engine = _Engine(model, engine.mc, deserialize=MultiprocessingSerializer.deserialize)
            updates = tw.HttpUpdates(stack.enter_context(http_bridge(engine)))
            stack.enter_context(torch_tensor_reduction())
        else:
            updates = tw.EngineUpdates(engine)
        _check_int8_then_structure(model, engine, updates, target, config, monkeypatch)


def _check_int8_then_structure(model, engine, updates, target, config, monkeypatch):
    r = tw.load_target_w8a8(updates, config, device="cpu", seed=5)
    assert r["ok"], r
    assert r["layers_loaded"] == r["layers"] == 4 and r["tensors"] == 4 * 4 * 2
    s = tw.load_target_structure(updates, str(target), device="cpu")
    assert s["ok"], s
    assert engine.updates == [("direct", "target")] * 4 + [(None, "target")]
    from safetensors.torch import load_file as load_safetensors

    structure = load_safetensors(str(target / "model.safetensors"))
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name, t in structure.items():
        assert torch.equal(state[name].to(t.dtype), t), name
    g = torch.Generator().manual_seed(0)
    for i, projs in enumerate(tw.target_projections(config)):
        sent = dict(tw.int8_layer(projs, i, 5, "cpu"))
        for p in projs:
            w, scale = sent[f"{p.name}.weight"], sent[f"{p.name}.weight_scale"]
            m = model.get_submodule(p.name)
            assert m.weight.shape == (p.k, p.n) and m.weight.stride() == (1, p.k), (p.name, m.weight.stride())
            assert torch.equal(m.weight, w) and torch.equal(m.weight_scale, scale), p.name
            # the layer computes x W^T with the checkpoint's W = w.t() dequantized by its scales
            x = torch.randn(3, p.k, generator=g).to(torch.bfloat16)
            want = x.float() @ (w.float() * scale.reshape(1, -1))
            got = layer_forward(m, x, monkeypatch).float()
            assert got.shape == (3, p.n)
            assert (got - want).norm() / want.norm() < 0.03, p.name  # int8 activations: ~1% of the norm
    assert set(dict(model.named_parameters())) <= {n for projs in tw.target_projections(config) for p in projs
                                                    for n, _, _ in tw.int8_specs(p)} | set(structure)


def test_after_the_int8_update_alone_the_weights_are_transposed(tiny_w8a8, monkeypatch):
    """What makes the structure's weight update necessary: sglang's end of the int8 weight update transposes each int8
    weight view again, so the GEMM refuses the weight (sgl_kernel's own check: column-major [k, n]); the next weight
    update's end turns it back (the test above)."""
    model, engine, target, config = tiny_w8a8
    assert tw.load_target_w8a8(tw.EngineUpdates(engine), config, device="cpu")["ok"]
    p = tw.target_projections(config)[0][0]
    m = model.get_submodule(p.name)
    assert m.weight.shape == (p.n, p.k)
    with pytest.raises(ValueError, match="mat_b"):
        layer_forward(m, torch.randn(2, p.k).to(torch.bfloat16), monkeypatch)


def test_a_wrong_name_fails_the_update_and_ends_the_session(tiny_w8a8, monkeypatch):
    """sglang's direct load raises on a name its model does not have; the harness's weight update still ends (the next
    weight update can begin)."""
    model, engine, target, config = tiny_w8a8
    monkeypatch.setattr(tw, "target_projections", lambda c: [(tw.Int8Projection("model.layers.0.qkv", 8, 16),)])
    with pytest.raises(KeyError, match="model.layers.0.qkv.weight"):
        tw.load_target_w8a8(tw.EngineUpdates(engine), config, device="cpu")
    assert engine.begin_weight_update("target")[0]
    assert engine.end_weight_update()[0]


def test_the_margin_request_is_sglangs_own_generate_request():
    """The server harness's logit-margin request (graphcap.bench.load.top_logprobs_payload) builds sglang's own
    GenerateReqInput - every field one it has - asking one greedy token and the top two with their text."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    from graphcap.bench import load

    req = GenerateReqInput(**load.top_logprobs_payload("a b c", 2))
    assert (req.return_logprob, req.top_logprobs_num, req.return_text_in_logprobs) == (True, 2, True)
    assert req.sampling_params == {"temperature": 0.0, "max_new_tokens": 1} and req.text == "a b c"
