"""graphcap.bench.target_weights: the user-scale target's structure and the W8A8 target's int8 projections, sent to
the target runner alone in one weight update each - here through an in-process engine's calls (recorded), and the
HTTP route's answer where no server listens. The HTTP payloads meet sglang's own request classes and scheduler-side
weight updater in tests/sglang_isolated/check_w8a8_target_load.py, and a whole harness run against the stand-in
server in tests/bench/test_server_harness.py."""
from __future__ import annotations

import pytest
from bench_scripts import load_bench_script, tiny_w8a8  # noqa: F401 - a fixture

from graphcap.bench import target_weights as tw


class _Engine:
    """sglang's Engine as load_target_structure and load_target_w8a8 use it, recording the calls (the real one needs
    a GPU; tests/sglang_isolated/check_w8a8_target_load.py answers them with sglang's own scheduler-side code).
    `update_ok`: every update's answer; `fail_at`: the one update (0-based) that fails."""

    def __init__(self, update_ok=True, begin_ok=True, fail_at=None):
        self.calls, self.update_ok, self.begin_ok, self.fail_at = [], update_ok, begin_ok, fail_at
        self.loop = self
        self.tokenizer_manager = self

    def begin_weight_update(self, selector):
        self.calls.append(("begin", selector))
        return self.begin_ok, "b"

    def _serialize_tensors_per_rank(self, named, load_format):
        self.calls.append(("serialize", [n for n, _ in named], load_format))
        return ["payload"]

    def update_weights_from_tensor(self, req, request):
        n = sum(c[0] == "update" for c in self.calls)
        self.calls.append(("update", req))
        return (self.update_ok and n != self.fail_at), "u"

    def run_until_complete(self, x):
        return x

    def end_weight_update(self):
        self.calls.append(("end",))
        return True, "e"


class _Req:
    def __init__(self, **kw):
        self.__dict__.update(kw)


@pytest.mark.parametrize("update_ok", [True, False])
def test_target_structure_goes_to_the_target_runner_alone(tmp_path, update_ok):
    """--structured: every tensor of the target checkpoint, as written by sglang_checkpoint.py, reaches sglang's
    update_weights_from_tensor with selector "target" between begin_weight_update and end_weight_update (ended also
    when the update fails), so the draft runner - whose load of the target's embeddings fails - is never asked."""
    ck = load_bench_script("sglang_checkpoint")
    from safetensors.torch import load_file

    ck.make_pair("tiny", tmp_path, device="cpu", sample=64)
    want = sorted(load_file(str(tmp_path / "target" / "model.safetensors")))
    eng = _Engine(update_ok=update_ok)
    r = tw.load_target_structure(tw.EngineUpdates(eng, _Req), str(tmp_path / "target"), device="cpu")
    assert [c[0] for c in eng.calls] == ["begin", "serialize", "update", "end"]
    assert eng.calls[0] == ("begin", "target") and sorted(eng.calls[1][1]) == want and len(want) == r["tensors"]
    req = eng.calls[2][1]
    assert req.selector == "target" and req.serialized_named_tensors == ["payload"] and req.flush_cache
    assert r["ok"] is update_ok


def test_a_refused_begin_loads_nothing(tmp_path):
    ck = load_bench_script("sglang_checkpoint")

    ck.make_pair("tiny", tmp_path, device="cpu", sample=64)
    eng = _Engine(begin_ok=False)
    r = tw.load_target_structure(tw.EngineUpdates(eng, _Req), str(tmp_path / "target"), device="cpu")
    assert not r["ok"] and "begin_weight_update" in r["message"] and [c[0] for c in eng.calls] == ["begin"]
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        tw.load_target_structure(tw.EngineUpdates(eng, _Req), str(tmp_path), device="cpu")


USER_SCALE_CONFIG = load_bench_script("sglang_checkpoint").configs(
    load_bench_script("sglang_checkpoint").SIZES["user-scale"], 1024, 32768, "w8a8")[0]


def test_user_scale_projections_are_the_fused_gemma4_shapes():
    """60 layers (5 sliding : 1 full) of four quantized projections each, in sglang's fused names: q;k;v from the
    sliding layers' 32 x 256 queries and 16 x 256 KV, the full layers' 32 x 512 and 4 x 512, gate;up from the FFN."""
    layers = tw.target_projections(USER_SCALE_CONFIG)
    assert len(layers) == 60
    sliding, full = layers[0], layers[5]
    assert [(p.name, p.n, p.k) for p in sliding] == [
        ("model.layers.0.self_attn.qkv_proj", (32 + 2 * 16) * 256, 5376),
        ("model.layers.0.self_attn.o_proj", 5376, 32 * 256), ("model.layers.0.mlp.gate_up_proj", 2 * 21504, 5376),
        ("model.layers.0.mlp.down_proj", 5376, 21504)]
    assert [(p.n, p.k) for p in full] == [((32 + 2 * 4) * 512, 5376), (5376, 32 * 512), (43008, 5376), (5376, 21504)]
    assert sum(p.n * p.k for projs in layers for p in projs) == 50 * 478_937_088 + 10 * 544_997_376  # 29.4 GB int8
    with pytest.raises(ValueError, match="attention_k_eq_v"):
        tw.target_projections({**USER_SCALE_CONFIG, "attention_k_eq_v": True})
    with pytest.raises(ValueError, match="layer 1 has layer type 'chunked'"):
        tw.target_projections({**USER_SCALE_CONFIG, "layer_types": ["sliding_attention", "chunked"]})


def test_int8_projection_is_seeded_int8_with_the_bf16_inits_scale():
    """The tensors carry int8_specs' names, shapes and dtypes; the weight spans [-127, 127]; the scales are positive,
    spread per channel, and give the dequantized weight an RMS of 1/sqrt(k); a seed gives the same tensors again,
    another seed others."""
    import torch

    p = tw.Int8Projection("model.layers.3.mlp.down_proj", 256, 1024)
    (wn, w), (sn, scale) = tw.int8_projection(p, 7, "cpu")
    assert [(n, tuple(t.shape), t.dtype) for n, t in ((wn, w), (sn, scale))] == [
        (n, shape, dtype) for n, shape, dtype in tw.int8_specs(p)]
    assert (wn, sn) == ("model.layers.3.mlp.down_proj.weight", "model.layers.3.mlp.down_proj.weight_scale")
    assert w.shape == (1024, 256) and scale.shape == (256, 1)  # sglang's layout: the checkpoint's [n, k] transposed
    assert int(w.min()) == -127 and int(w.max()) == 127
    assert bool((scale > 0).all()) and float(scale.max() / scale.min()) > 2
    rms = (w.float() * scale.reshape(1, -1)).pow(2).mean().sqrt().item()
    assert rms == pytest.approx(1 / 1024 ** 0.5, rel=0.03)
    again = tw.int8_projection(p, 7, "cpu")
    assert torch.equal(again[0][1], w) and torch.equal(again[1][1], scale)
    assert not torch.equal(tw.int8_projection(p, 8, "cpu")[0][1], w)


def test_w8a8_loads_each_layer_direct_to_the_target_runner(tiny_w8a8):
    """One weight update on the target runner: per layer one update with load_format "direct" holding that layer's four
    projections (weight and scale each), the layers in order; the record counts what went."""
    import json

    config = json.loads((tiny_w8a8 / "target" / "config.json").read_text())
    eng = _Engine()
    r = tw.load_target_w8a8(tw.EngineUpdates(eng, _Req), config, device="cpu")
    assert r["ok"] and r["layers"] == r["layers_loaded"] == 4 and r["tensors"] == 32 and r["load_format"] == "direct"
    kinds = [c[0] for c in eng.calls]
    assert kinds == ["begin"] + ["serialize", "update"] * 4 + ["end"] and eng.calls[0] == ("begin", "target")
    layers = tw.target_projections(config)
    for i, projs in enumerate(layers):
        _, names, load_format = eng.calls[1 + 2 * i]
        assert load_format == "direct" and names == [n for p in projs for n, _, _ in tw.int8_specs(p)]
        req = eng.calls[2 + 2 * i][1]
        assert (req.selector, req.load_format) == ("target", "direct")
    assert r["bytes"] == sum(p.n * p.k + 4 * p.n for projs in layers for p in projs)


def test_a_failed_layer_stops_the_load_and_ends_the_session(tiny_w8a8):
    import json

    config = json.loads((tiny_w8a8 / "target" / "config.json").read_text())
    eng = _Engine(fail_at=2)
    r = tw.load_target_w8a8(tw.EngineUpdates(eng, _Req), config, device="cpu")
    assert not r["ok"] and r["layers_loaded"] == 2 and r["message"] == "batch 2: u"
    assert [c[0] for c in eng.calls][-3:] == ["serialize", "update", "end"]
    eng = _Engine(begin_ok=False)
    r = tw.load_target_w8a8(tw.EngineUpdates(eng, _Req), config, device="cpu")
    assert not r["ok"] and "begin_weight_update" in r["message"] and [c[0] for c in eng.calls] == ["begin"]


def test_the_checkpoints_weights_are_read_from_its_config(tiny_w8a8, tmp_path):
    import json

    ck = load_bench_script("sglang_checkpoint")
    config = json.loads((tiny_w8a8 / "target" / "config.json").read_text())
    assert config["quantization_config"] == ck.W8A8_QUANTIZATION and tw.checkpoint_weights(config) == "w8a8"
    bf16, _ = ck.configs(ck.SIZES["tiny"], 1024, 32768)
    assert "quantization_config" not in bf16 and tw.checkpoint_weights(bf16) == "bf16"
    fp8 = {"quantization_config": {"quant_method": "compressed-tensors",
                                   "config_groups": {"g": {"weights": {"type": "float", "num_bits": 8}}}}}
    assert tw.checkpoint_weights(fp8) == "bf16"
    with pytest.raises(ValueError, match="weights must be one of bf16, w8a8, got 'int4'"):
        ck.configs(ck.SIZES["tiny"], 1024, 32768, "int4")


@pytest.mark.parametrize("batch_bytes", [None, 1, 3000, 40000])
def test_structure_batches_hold_every_tensor_once_within_their_size(tmp_path, batch_bytes):
    """Against the checkpoint read whole: every tensor once, in file order, bit-equal; each batch within
    `batch_bytes` unless a tensor alone is larger; the load sends one update per batch inside one weight update."""
    import torch
    from safetensors.torch import load_file

    load_bench_script("sglang_checkpoint").make_pair("tiny", tmp_path, device="cpu", sample=64)
    whole = load_file(str(tmp_path / "target" / "model.safetensors"))
    batches = list(tw.structure_batches(str(tmp_path / "target"), "cpu", batch_bytes))
    got = [(n, t) for b in batches for n, t in b]
    assert sorted(n for n, _ in got) == sorted(whole) and len(got) == len(whole)
    assert all(torch.equal(t, whole[n]) for n, t in got)
    for b in batches:
        size = sum(t.numel() * t.element_size() for _, t in b)
        assert batch_bytes is None or len(b) == 1 or size <= batch_bytes
    if batch_bytes in (None, 1):  # one batch, or a batch per tensor
        assert len(batches) == (1 if batch_bytes is None else len(whole))
    else:  # greedy: two neighbouring batches would not have fitted in one
        sizes = [sum(t.numel() * t.element_size() for _, t in b) for b in batches]
        assert all(a + b > batch_bytes for a, b in zip(sizes, sizes[1:]))
    eng = _Engine()
    r = tw.load_target_structure(tw.EngineUpdates(eng, _Req), str(tmp_path / "target"), device="cpu",
                                 batch_bytes=batch_bytes)
    assert r["ok"] and r["batches"] == len(batches) and r["tensors"] == len(whole)
    assert [c[0] for c in eng.calls] == ["begin"] + ["serialize", "update"] * len(batches) + ["end"]


def test_a_server_that_does_not_answer_is_named():
    """HttpUpdates against a port nothing listens on: each call answers (False, the route and why), no exception."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    updates = tw.HttpUpdates(f"http://127.0.0.1:{port}", timeout_s=2)
    ok, msg = updates.begin()
    assert not ok and msg.startswith("/begin_weight_update: HTTP no answer")
    r = tw.load_target_w8a8(updates, {"hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2,
                                      "num_key_value_heads": 1, "head_dim": 4, "layer_types": ["sliding_attention"]},
                            device="cpu")
    assert not r["ok"] and r["layers_loaded"] == 0 and "begin_weight_update" in r["message"]


def test_release_empties_the_cache_after_collecting_ipc(monkeypatch):
    """A CUDA batch's memory goes back to the driver - collected from IPC, then emptied from torch's cache - so the
    engine's scheduler keeps the headroom it sized at start-up; a CPU batch touches neither."""
    import torch

    calls = []
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: calls.append("ipc_collect"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    tw._release("cpu")
    assert calls == []
    tw._release("cuda:0")
    assert calls == ["ipc_collect", "empty_cache"]


@pytest.mark.parametrize("fail_at", [None, 1])
def test_every_load_ends_with_its_memory_released(tiny_w8a8, monkeypatch, fail_at):
    """The last release follows the last update, also where a failed update stopped the load with its batch built."""
    import json

    config = json.loads((tiny_w8a8 / "target" / "config.json").read_text())
    for load in ("w8a8", "structure"):
        eng = _Engine(fail_at=fail_at)
        monkeypatch.setattr(tw, "_release", lambda device, eng=eng: eng.calls.append(("release", device)))
        if load == "w8a8":
            tw.load_target_w8a8(tw.EngineUpdates(eng, _Req), config, device="cpu")
        else:
            tw.load_target_structure(tw.EngineUpdates(eng, _Req), str(tiny_w8a8 / "target"), device="cpu",
                                     batch_bytes=1 << 16)
        kinds = [c[0] for c in eng.calls]
        assert kinds[-2:] == ["end", "release"] and eng.calls[-1] == ("release", "cpu"), (load, kinds)
        assert kinds.count("update") == 2 if fail_at == 1 else kinds.count("update") >= 2, (load, kinds)


@pytest.mark.gpu
def test_a_sent_layer_leaves_no_gpu_memory_reserved(tiny_w8a8):
    """On a GPU: a W8A8 load whose layers the receiver has dropped leaves this process holding none of their memory -
    torch's cache emptied, not only the tensors freed - so the engine's scheduler keeps its headroom."""
    import json

    import torch

    config = json.loads((tiny_w8a8 / "target" / "config.json").read_text())
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    r = tw.load_target_w8a8(tw.EngineUpdates(_Engine(), _Req), config, device="cuda")
    assert r["ok"] and r["bytes"] > 0
    assert torch.cuda.memory_reserved() <= before
