"""Write a Gemma 4 target + MTP assistant checkpoint pair that sglang 0.5.23 loads (`Gemma4ForCausalLM`,
`Gemma4AssistantForCausalLM`, frozen-KV MTP), with weights built so that the draft's acceptance is real and set.

    python bench/sglang_checkpoint.py --size tiny|draft-shapes|user-scale --out DIR [--disagree 0.3] [--seed 0]
        [--device cuda] [--max-pos 32768] [--weights bf16|w8a8]

Both models predict a function of the last token; their layers add small (nonzero) residuals:
- target: greedy next token after x is x+1 (mod V);
- assistant: greedy next token after x is tau(x+1), tau swapping a fraction `disagree` of the vocabulary in pairs,
  so a draft step is accepted unless the token it drafts is swapped: mean accept length ~ 1 + p + ... + p^k.
Writes DIR/target and DIR/assistant (config.json, generation_config.json, model.safetensors, and a word-level
tokenizer over the whole vocabulary: tokenizer.json, tokenizer_config.json with a chat template) and DIR/summary.json
(margins and intended-token fractions from a float32 emulation of both heads, layers ignored). With the tokenizer,
sglang's server tokenizes, detokenizes and streams text as it does for a real model: token `i` is the word `w<i>`
(a few ids are chat-template words), so any token sequence survives text and back unchanged.

`--weights w8a8`: the target's config.json declares the user's INT8 W8A8 quantization (compressed-tensors, `W8A8`:
int8 weights with per-output-channel fp32 scales, dynamic per-token int8 activations; lm_head left out, embeddings and
norms bf16 as in the user's checkpoint), so sglang builds every linear layer of the target as its W8A8 int8 scheme.
The checkpoint then holds the target's structure alone at every size (embeddings, lm_head, norms, layer scalars):
bench/sglang_user_scale.py loads int8 projections of its own into the engine. The assistant stays bf16.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

BF16 = torch.bfloat16
BRANCH_GAIN = 0.05  # post-attention / post-FFN norm weight: each branch adds RMS 0.05 to a stream of RMS ~1
ALPHA2 = 0.3  # share of |E[t]|^2 in pre_projection's range (what the assistant sees); the rest is private to the target
CLUSTER2 = 0.5  # share of |lm_head_d[y]|^2 shared by y's centroid cluster (so the centroid top-k finds it)
PREV_GAIN = 0.05  # |prev_hidden part of pre_projection output| relative to the token part: participates, never decides
SL, FU = "sliding_attention", "full_attention"
WEIGHTS = ("bf16", "w8a8")
# compressed-tensors' W8A8 int8 as sglang reads it (CompressedTensorsConfig.from_config -> CompressedTensorsW8A8Int8):
# every Linear module, weights int8 per output channel (static, symmetric), activations int8 per token (dynamic,
# symmetric); lm_head stays bf16. The embeddings are no Linear module and stay bf16 without naming them.
W8A8_QUANTIZATION = {
    "quant_method": "compressed-tensors", "format": "int-quantized",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}}},
    "ignore": ["lm_head"],
}
# The tokenizer's words: the special tokens at the ids the configs name (pad 0, eos 1, bos 2), then the chat template's
# words, then `w<id>` for every other id. Word-level over whitespace: text and ids convert both ways exactly.
SPECIAL_WORDS = ("<pad>", "<eos>", "<bos>", "<unk>")
TEMPLATE_WORDS = ("turn", "system", "user", "assistant")
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}turn {{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}turn assistant {% endif %}")


@dataclass(frozen=True)
class Shapes:
    vocab: int
    t_hidden: int  # = the assistant's backbone_hidden_size
    t_types: tuple[str, ...]  # last two must be (sliding, full): sglang maps assistant layers to them by type
    t_ffn: int
    q_heads: int  # target and assistant (both sliding and full layers)
    swa_kv: int
    swa_hd: int
    full_kv: int
    full_hd: int
    d_hidden: int
    d_types: tuple[str, ...]
    d_ffn: int
    centroids: int  # vocab must be a multiple (sglang checks); clusters = contiguous token blocks
    top_k: int


SIZES = {
    "tiny": Shapes(vocab=1024, t_hidden=256, t_types=(SL, SL, SL, FU), t_ffn=512, q_heads=4, swa_kv=2, swa_hd=64,
                   full_kv=1, full_hd=128, d_hidden=128, d_types=(SL, SL, SL, FU), d_ffn=256, centroids=32, top_k=4),
    # The real draft's shapes over a 2-layer target with the real KV shapes (16x256 sliding, 4x512 full).
    "draft-shapes": Shapes(vocab=262144, t_hidden=5376, t_types=(SL, FU), t_ffn=21504, q_heads=32, swa_kv=16,
                           swa_hd=256, full_kv=4, full_hd=512, d_hidden=1536, d_types=(SL, SL, SL, FU), d_ffn=6144,
                           centroids=2048, top_k=32),
    # The user's scale: a Gemma-4-31B-shaped target (60 layers, 5 sliding : 1 full) with the draft-shapes assistant.
    # Its layers' matrices are not written (`target_matrices=False`: 60 GB): the engine loads the target with
    # load_format="dummy" and then this checkpoint's structure (embeddings, lm_head, norms) over it.
    "user-scale": Shapes(vocab=262144, t_hidden=5376, t_types=(SL,) * 5 + (FU,) + ((SL,) * 5 + (FU,)) * 9,
                         t_ffn=21504, q_heads=32, swa_kv=16, swa_hd=256, full_kv=4, full_hd=512, d_hidden=1536,
                         d_types=(SL, SL, SL, FU), d_ffn=6144, centroids=2048, top_k=32),
}


def _text_config(s: Shapes, hidden: int, ffn: int, types: tuple[str, ...], window: int, max_pos: int) -> dict:
    """Keys both text configs share. PLE / MoE / double-wide MLP off (the assistant's config validator demands it;
    sglang would otherwise build per-layer embeddings); softcapping off (monotone anyway, keeps logits plain)."""
    return {
        "model_type": "gemma4_text", "vocab_size": s.vocab, "hidden_size": hidden, "intermediate_size": ffn,
        "num_hidden_layers": len(types), "layer_types": list(types), "num_attention_heads": s.q_heads,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": max_pos, "rms_norm_eps": 1e-6,
        # sglang's attention uses sliding_window - 1 as its (exclusive) window, in the target and the assistant alike
        "sliding_window": window,
        "rope_parameters": {SL: {"rope_type": "default", "rope_theta": 10000.0},
                            FU: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}},
        "final_logit_softcapping": None, "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
        "enable_moe_block": False, "use_double_wide_mlp": False, "attention_bias": False,
        "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "dtype": "bfloat16",
    }


def configs(s: Shapes, window: int, max_pos: int, weights: str = "bf16") -> tuple[dict, dict]:
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    target = {"architectures": ["Gemma4ForCausalLM"],
              **_text_config(s, s.t_hidden, s.t_ffn, s.t_types, window, max_pos),
              # model_type gemma4_text gets no Gemma 4 override in sglang's get_config: state its names directly.
              # head_dim / num_key_value_heads are the full layers', swa_* the sliding layers'. per_layer_config {}
              # stops transformers building one (with one, `hasattr(config, "head_dim")` raises in sglang).
              "num_key_value_heads": s.full_kv, "head_dim": s.full_hd, "v_head_dim": s.full_hd,
              "swa_num_key_value_heads": s.swa_kv, "swa_head_dim": s.swa_hd, "swa_v_head_dim": s.swa_hd,
              "per_layer_config": {}, "num_kv_shared_layers": 0, "attention_k_eq_v": False,
              "tie_word_embeddings": False}  # lm_head row y = E[y-1] (next token x+1), not E[y]
    if weights == "w8a8":
        target["quantization_config"] = json.loads(json.dumps(W8A8_QUANTIZATION))  # a copy: callers may edit theirs
    text = {**_text_config(s, s.d_hidden, s.d_ffn, s.d_types, window, max_pos),
            # gemma4_assistant IS overridden by sglang (_apply_gemma4_attention_overrides): it overwrites swa_* from
            # transformers' per_layer_config, so state the split the transformers way: base = sliding, global = full.
            # transformers applies num_global_key_value_heads only with attention_k_eq_v; the assistant has no K/V
            # projections (it reads the target's KV), so k_eq_v changes nothing else in sglang.
            "num_key_value_heads": s.swa_kv, "head_dim": s.swa_hd, "global_head_dim": s.full_hd,
            "num_global_key_value_heads": s.full_kv, "attention_k_eq_v": True,
            "num_kv_shared_layers": len(s.d_types), "tie_word_embeddings": True}  # lm_head = model.embed_tokens
    assistant = {"architectures": ["Gemma4AssistantForCausalLM"], "model_type": "gemma4_assistant",
                 "backbone_hidden_size": s.t_hidden, "use_ordered_embeddings": True, "num_centroids": s.centroids,
                 "centroid_intermediate_top_k": s.top_k, "tie_word_embeddings": True, "dtype": "bfloat16",
                 "text_config": text}
    return target, assistant


def _unit(n: int, d: int, gen: torch.Generator, dev: str) -> torch.Tensor:
    x = torch.randn(n, d, generator=gen, device=dev)
    return x / x.norm(dim=1, keepdim=True)


def _layers(prefix: str, s: Shapes, hidden: int, ffn: int, types: tuple[str, ...], with_kv: bool,
            gen: torch.Generator, dev: str, matrices: bool = True) -> dict[str, torch.Tensor]:
    """HF names; sglang's load_weights stacks q/k/v into qkv_proj and gate/up into gate_up_proj. Random projections
    (the kernels run on real-looking data); the branch outputs are RMS-normalised by post_*_layernorm, so their
    weights (BRANCH_GAIN), not o_proj/down_proj's scale, set how much a layer moves the stream. Norms multiply by w
    (sglang's RMSNorm, and Gemma4RMSNorm at scale_shift 0), so ones = identity scale."""
    def lin(o: int, i: int) -> torch.Tensor | None:
        if not matrices:  # the structure alone (norms, scalars): the projections come from elsewhere
            return None
        return (torch.randn(o, i, generator=gen, device=dev) / math.sqrt(i)).to(BF16).cpu()

    def const(n: int, v: float) -> torch.Tensor:
        return torch.full((n,), v, dtype=BF16)

    w: dict[str, torch.Tensor] = {}
    for i, t in enumerate(types):
        p, (kv, hd) = f"{prefix}.layers.{i}", ((s.swa_kv, s.swa_hd) if t == SL else (s.full_kv, s.full_hd))
        w[f"{p}.self_attn.q_proj.weight"] = lin(s.q_heads * hd, hidden)
        w[f"{p}.self_attn.q_norm.weight"] = const(hd, 1.0)
        if with_kv:  # the assistant's real checkpoints have no k/v projections (its K/V come from the target)
            w[f"{p}.self_attn.k_proj.weight"] = lin(kv * hd, hidden)
            w[f"{p}.self_attn.v_proj.weight"] = lin(kv * hd, hidden)
            w[f"{p}.self_attn.k_norm.weight"] = const(hd, 1.0)
        w[f"{p}.self_attn.o_proj.weight"] = lin(hidden, s.q_heads * hd)
        w[f"{p}.mlp.gate_proj.weight"] = lin(ffn, hidden)
        w[f"{p}.mlp.up_proj.weight"] = lin(ffn, hidden)
        w[f"{p}.mlp.down_proj.weight"] = lin(hidden, ffn)
        for n, v in (("input_layernorm", 1.0), ("pre_feedforward_layernorm", 1.0),
                     ("post_attention_layernorm", BRANCH_GAIN), ("post_feedforward_layernorm", BRANCH_GAIN)):
            w[f"{p}.{n}.weight"] = const(hidden, v)
        w[f"{p}.layer_scalar"] = const(1, 1.0)  # a persistent buffer sglang loads; it scales the whole stream
    w[f"{prefix}.norm.weight"] = const(hidden, 1.0)
    return {k: v for k, v in w.items() if v is not None}


def build(s: Shapes, disagree: float, seed: int, dev: str, target_matrices: bool = True
          ) -> tuple[dict, dict, torch.Tensor]:
    """Returns (target tensors, assistant tensors, tau). Construction, with Hb = target hidden, Hd = assistant hidden:
    lm_head_d[y] = a*u[c(y)] + b*w[y] (u: per-cluster unit vectors = centroid rows; c(y) = y // (V/C));
    P: Hd x Hb, orthonormal rows (a signed coordinate selection: every quantity below is invariant under a rotation
    of either space, so a dense random P would be the same experiment at a V*Hb*Hd matmul's cost);
    E[t] = sqrt(ALPHA2) * P^T lm_head_d[tau(t+1)] + sqrt(1-ALPHA2) * (unit vector in P's null space), so
    P E[x] = sqrt(ALPHA2) lm_head_d[tau(x+1)] (the draft's pick) and the target (lm_head[y] = E[y-1]) sees mostly
    the private part: its same-cluster similarity is only ALPHA2*CLUSTER2."""
    V, Hb, Hd, C = s.vocab, s.t_hidden, s.d_hidden, s.centroids
    assert Hb > Hd and V % C == 0 and 0.0 <= disagree <= 1.0
    gen = torch.Generator(device=dev).manual_seed(seed)
    cpu = torch.Generator().manual_seed(seed + 1)
    # tau: an involution swapping round(disagree*V/2) random pairs
    perm, n_swap = torch.randperm(V, generator=cpu), int(round(disagree * V / 2))
    tau = torch.arange(V)
    tau[perm[:n_swap]], tau[perm[n_swap:2 * n_swap]] = perm[n_swap:2 * n_swap], perm[:n_swap]
    u = _unit(C, Hd, gen, dev)
    lm_d = math.sqrt(CLUSTER2) * u.repeat_interleave(V // C, 0) + math.sqrt(1 - CLUSTER2) * _unit(V, Hd, gen, dev)
    lm_d = lm_d / lm_d.norm(dim=1, keepdim=True)
    coords = torch.randperm(Hb, generator=cpu).to(dev)
    sel, rest = coords[:Hd], coords[Hd:]
    sign = torch.randint(0, 2, (Hd,), generator=cpu).to(dev).float() * 2 - 1
    nxt = tau[(torch.arange(V) + 1) % V].to(dev)  # the token the draft should pick after t
    E = torch.empty(V, Hb, dtype=BF16)
    for a in range(0, V, 16384):  # chunks: a V x Hb float32 table would be 5.6 GB at draft shapes
        b = min(a + 16384, V)
        e = torch.zeros(b - a, Hb, device=dev)
        e[:, sel] = math.sqrt(ALPHA2) * sign * lm_d[nxt[a:b]]
        e[:, rest] = math.sqrt(1 - ALPHA2) * _unit(b - a, Hb - Hd, gen, dev)
        E[a:b] = e.to(BF16).cpu()
    target = {"model.embed_tokens.weight": E, "lm_head.weight": torch.roll(E, 1, 0),  # lm_head[y] = E[y-1]
              **_layers("model", s, Hb, s.t_ffn, s.t_types, True, gen, dev, matrices=target_matrices)}
    # pre_projection([E[x]*sqrt(Hb), prev_hidden]): the token half is P scaled so its output has RMS ~1; the
    # prev_hidden half (RMS ~1 input, the target's normed hidden or post_projection's) adds RMS ~PREV_GAIN
    proj = torch.zeros(Hd, Hb, device=dev)
    proj[torch.arange(Hd, device=dev), sel] = sign
    tok_half = proj * math.sqrt(Hd / Hb) / math.sqrt(ALPHA2)
    prev_half = torch.randn(Hd, Hb, generator=gen, device=dev) * PREV_GAIN / math.sqrt(Hb)
    assistant = {"pre_projection.weight": torch.cat([tok_half, prev_half], 1).to(BF16).cpu(),
                 # P^T, scaled so the recurrent hidden it hands the next step has RMS ~1 like the target's
                 "post_projection.weight": (proj.T * math.sqrt(Hb / Hd)).contiguous().to(BF16).cpu(),
                 "model.embed_tokens.weight": lm_d.to(BF16).cpu(),  # tied: this is the assistant's lm_head
                 # sglang strips "masked_embedding."; identity ordering makes its lm_head reorder a no-op
                 "masked_embedding.centroids.weight": u.to(BF16).cpu(),
                 "masked_embedding.token_ordering": torch.arange(V, dtype=torch.int64),
                 **_layers("model", s, Hd, s.d_ffn, s.d_types, False, gen, dev)}
    return target, assistant, tau


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _top2(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    v, i = logits.topk(2, dim=-1)
    return i[:, 0], v[:, 0] - v[:, 1]


def check(s: Shapes, tw: dict, dw: dict, tau: torch.Tensor, sample: int, seed: int, dev: str) -> dict:
    """float32 emulation of both heads from the bf16 tensors written (layers skipped: they only add BRANCH_GAIN-sized
    residuals): target embed*sqrt(Hb) -> final norm -> lm_head; assistant cat[embed*sqrt(Hb), target's normed hidden
    at the previous token] -> pre_projection -> final norm -> centroid top-k -> lm_head over the selected clusters."""
    V, Hb, vpc = s.vocab, s.t_hidden, s.vocab // s.centroids
    xs = (torch.arange(V) if sample >= V else
          torch.randperm(V, generator=torch.Generator().manual_seed(seed + 2))[:sample]).sort().values
    E = tw["model.embed_tokens.weight"]
    h = _rms(E[xs].to(dev).float() * math.sqrt(Hb))
    best = torch.full((len(xs), 2), -math.inf, device=dev)
    arg = torch.zeros(len(xs), 2, dtype=torch.long, device=dev)
    head = tw["lm_head.weight"]
    for a in range(0, V, 16384):  # running top-2 over vocabulary chunks
        v, i = (h @ head[a:a + 16384].to(dev).float().T).topk(2, dim=-1)
        v, j = torch.cat([best, v], 1).topk(2, dim=-1)
        arg, best = torch.cat([arg, i + a], 1).gather(1, j), v
    t_pick, t_margin = arg[:, 0].cpu(), (best[:, 0] - best[:, 1]).cpu()
    prev = _rms(E[(xs - 1) % V].to(dev).float() * math.sqrt(Hb))
    z = torch.cat([E[xs].to(dev).float() * math.sqrt(Hb), prev], 1) @ dw["pre_projection.weight"].to(dev).float().T
    n = _rms(z)
    cl = n @ dw["masked_embedding.centroids.weight"].to(dev).float().T
    top = cl.topk(s.top_k, dim=-1).indices  # [S, k]
    toks = (top[:, :, None] * vpc + torch.arange(vpc, device=dev)).reshape(len(xs), -1)
    lm = dw["model.embed_tokens.weight"].to(dev).float()
    d_logits = torch.einsum("sh,sth->st", n, lm[toks])
    j, d_margin = _top2(d_logits)
    d_pick = toks.gather(1, j[:, None])[:, 0].cpu()
    want_t, want_d = (xs + 1) % V, tau[(xs + 1) % V]
    rank = (cl > cl.gather(1, (want_d.to(dev) // vpc)[:, None])).sum(1)  # intended cluster's centroid rank
    agree = (tau == torch.arange(V))  # a drafted token t is accepted iff tau(t) = t
    runs = torch.stack([agree.roll(-j) for j in range(1, 8)], 1).cumprod(1)  # runs[x, j-1]: steps 1..j all accepted
    accept = {str(k): round(1 + runs[:, :k].sum(1).float().mean().item(), 4) for k in range(1, 8)}
    p = agree.float().mean().item()

    def stats(m: torch.Tensor) -> dict:
        return {"min": round(m.min().item(), 3), "mean": round(m.mean().item(), 3)}

    return {
        "sample": len(xs),
        "target": {"intended_frac": (t_pick == want_t).float().mean().item(), "margin": stats(t_margin),
                   "top1_logit_mean": round(best[:, 0].mean().item(), 3)},
        "assistant": {"intended_frac": (d_pick == want_d).float().mean().item(), "margin": stats(d_margin.cpu()),
                      "agrees_with_target_frac": (d_pick == want_t).float().mean().item(),
                      "intended_cluster_rank_max": int(rank.max().item()), "top_k": s.top_k},
        "swapped_frac": round(1 - p, 4),
        "expected_accept_length_by_steps": accept,  # exact over every start token; ~ 1 + p + ... + p^k
        "formula_1_p_p2_p3": round(1 + p + p * p + p ** 3, 4),
    }


def word(i: int) -> str:
    """The word of token id `i` in the checkpoints' tokenizer."""
    fixed = SPECIAL_WORDS + TEMPLATE_WORDS
    return fixed[i] if i < len(fixed) else f"w{i}"


def write_tokenizer(directory: Path, vocab: int, max_pos: int) -> None:
    """A word-level tokenizer over ids [0, vocab) (`word`), whitespace-split, no special tokens added on encoding
    (the chat template writes the bos), with transformers' files: tokenizer.json and tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({word(i): i for i in range(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(w, special=True, normalized=False) for w in SPECIAL_WORDS])
    tok.save(str(directory / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "eos_token": "<eos>",
           "bos_token": "<bos>", "unk_token": "<unk>", "model_max_length": max_pos, "clean_up_tokenization_spaces": False,
           "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def make_pair(size: str, out: str | Path, disagree: float = 0.3, seed: int = 0, device: str = "cuda",
              window: int = 1024, max_pos: int = 32768, sample: int = 2048, weights: str = "bf16") -> dict:
    """Write out/target and out/assistant; returns the summary (also out/summary.json). The user-scale target, and a
    w8a8 target at any size, holds no projection matrices (`summary["target_matrices"]` is false): load it with
    load_format="dummy", then its structure over them (graphcap.bench.target_weights.load_target_structure), after
    the int8 projections for w8a8 (load_target_w8a8 there)."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    s, out = SIZES[size], Path(out)
    torch.manual_seed(seed)
    matrices = size != "user-scale" and weights == "bf16"
    with torch.no_grad():
        tw, dw, tau = build(s, disagree, seed, device, target_matrices=matrices)
        summary = {"size": size, "seed": seed, "disagree": disagree, "sliding_window_config": window,
                   "target_matrices": matrices, "weights": weights, "max_position_embeddings": max_pos,
                   "sglang_window_tokens": window - 1,  # both models: get_attention_sliding_window_size = w - 1
                   **check(s, tw, dw, tau, sample, seed, device)}
    tcfg, dcfg = configs(s, window, max_pos, weights)
    gen_cfg = {"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}
    for name, cfg, w in (("target", tcfg, tw), ("assistant", dcfg, dw)):
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (d / "generation_config.json").write_text(json.dumps(gen_cfg) + "\n")
        save_file({k: v.contiguous() for k, v in w.items()}, str(d / "model.safetensors"), metadata={"format": "pt"})
        write_tokenizer(d, s.vocab, max_pos)
        summary[f"{name}_bytes"] = sum(v.numel() * v.element_size() for v in w.values())
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--disagree", type=float, default=0.3, help="fraction of tokens the draft maps wrongly")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--window", type=int, default=1024, help="config.sliding_window (sglang attends to window-1)")
    ap.add_argument("--max-pos", type=int, default=32768, help="max_position_embeddings (sglang's context length)")
    ap.add_argument("--sample", type=int, default=2048, help="tokens checked by the head emulation")
    ap.add_argument("--weights", choices=WEIGHTS, default="bf16",
                    help="the target's linear layers: bf16, or the user's INT8 W8A8 (compressed-tensors; the "
                         "checkpoint then holds the target's structure alone, the harness loads the int8 layers)")
    a = ap.parse_args(argv)
    if a.max_pos < 1:
        ap.error(f"--max-pos must be a positive number of positions, got {a.max_pos}")
    summary = make_pair(a.size, a.out, a.disagree, a.seed, a.device, a.window, a.max_pos, a.sample, a.weights)
    print(json.dumps(summary, indent=2))
    ok = summary["target"]["intended_frac"] == 1.0 and summary["assistant"]["intended_frac"] == 1.0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
