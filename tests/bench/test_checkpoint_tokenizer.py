"""bench/sglang_checkpoint.py's tokenizer, as sglang's server loads it (transformers' AutoTokenizer): every token
sequence survives decode and encode unchanged (what lets the server harness compare servers' outputs by text), the
special tokens sit at the ids the configs name, and the chat template renders the words it needs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench_scripts import load_bench_script
from tiers import examples

ck = load_bench_script("sglang_checkpoint")

VOCAB = 4096  # the writer is the same at 262144; a small vocabulary keeps the test quick


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    # sglang first where it is installed, as in its server: `import sglang` after transformers replaces the module
    # aliases transformers made at import, which the process-state guard would count against the next test
    try:
        import sglang  # noqa: F401
    except ImportError:
        pass
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("tok")
    ck.write_tokenizer(d, VOCAB, max_pos=8192)
    return transformers.AutoTokenizer.from_pretrained(str(d))


@settings(max_examples=examples(60), deadline=None)
@given(ids=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=200))
def test_ids_survive_text(tokenizer, ids):
    assert tokenizer.encode(tokenizer.decode(ids)) == ids


def test_words_and_special_ids(tokenizer, tmp_path):
    assert len({ck.word(i) for i in range(VOCAB)}) == VOCAB
    gen = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}  # what make_pair's generation_config says
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) == tuple(gen.values())
    assert tokenizer.num_special_tokens_to_add() == 0  # sglang's bench sizes prompts by this
    assert tokenizer.decode([57, 1, 58], skip_special_tokens=True) == "w57 w58"
    cfg = json.loads((Path(tokenizer.name_or_path) / "tokenizer_config.json").read_text())
    assert cfg["model_max_length"] == 8192


def test_chat_template_renders_known_words(tokenizer):
    msgs = [{"role": "system", "content": "w10 w11"}, {"role": "user", "content": "w12"},
            {"role": "assistant", "content": "w13 w14"}, {"role": "user", "content": "w15"}]
    ids = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    turn, system, user, assistant = (ck.TEMPLATE_WORDS.index(w) + len(ck.SPECIAL_WORDS) for w in ck.TEMPLATE_WORDS)
    assert ids == [2, turn, system, 10, 11, turn, user, 12, turn, assistant, 13, 14, turn, user, 15, turn, assistant]
    assert 3 not in ids  # no unknown word
