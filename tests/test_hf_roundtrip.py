"""Acceptance: a Hugging Face model directory sent with the real CLI processes arrives loadable.

A tiny GPT-2 is built from a config (no hub access), saved with its
generation config and a tokenizer, sent with ``tensorxfer-send DIR`` to
``tensorxfer-recv``, and loaded back with ``from_pretrained``: the logits on a
fixed input must be identical and the tokenizer must encode the same ids.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers import finish
from tests.test_cli import cli, sha, start_recv

transformers = pytest.importorskip("transformers", reason="the acceptance test needs transformers (pip install "
                                                           "'tensorxfer[test]')")
torch = pytest.importorskip("torch", reason="transformers models need PyTorch")
tokenizers = pytest.importorskip("tokenizers", reason="the tokenizer part needs the tokenizers package")


def tiny_model_dir(d):
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.generation_config.max_new_tokens = 7           # a non-default value, so generation_config.json matters
    try:
        model.save_pretrained(d, safe_serialization=True)
    except TypeError:                                    # newer transformers: safetensors is the only format
        model.save_pretrained(d)
    vocab = {w: i for i, w in enumerate(["[UNK]", "[PAD]", "hello", "world", "tensor", "xfer", "model"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
    fast.save_pretrained(d)
    return model


def test_hf_model_dir_arrives_loadable_with_identical_logits(tmp_path):
    src, out = tmp_path / "gpt2-tiny", tmp_path / "received"
    model = tiny_model_dir(src)
    names = sorted(os.listdir(src))
    assert "config.json" in names and "generation_config.json" in names and "tokenizer.json" in names

    recv, where = start_recv(out, "--once")
    rc_s, out_s, err_s = finish(cli("send", str(src), "--to", where, "--verify", "--json"), timeout=60)
    rc_r, _, err_r = finish(recv, timeout=60)
    assert rc_s == 0, err_s
    assert rc_r == 0, err_r
    sent = json.loads(out_s)
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= set(sent["side_files"])
    assert sorted(os.listdir(out)) == names
    for n in names:
        assert sha(src / n) == sha(out / n), n

    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.generation_config.max_new_tokens == 7
    ids = torch.tensor([[3, 141, 59, 26, 535, 897, 9, 32]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("hello tensor xfer world")["input_ids"] == [2, 4, 5, 3]
