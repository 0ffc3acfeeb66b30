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


@pytest.mark.slow
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


def fp8_model_dir(d):
    """A tiny Llama saved as an FP8 checkpoint the way DeepSeek-V3 / Qwen3-FP8 ship: every linear weight
    float8_e4m3fn with its weight_scale_inv (128 x 128 blocks, quantized by transformers' own quantizer),
    the rest bf16, and a ``quantization_config`` transformers reads."""
    import types

    from safetensors.torch import save_file
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                                      max_position_embeddings=32, architectures=["LlamaForCausalLM"])
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    quantize = Fp8Quantize(types.SimpleNamespace(
        quantization_config=transformers.FineGrainedFP8Config(weight_block_size=[128, 128])))
    weights: dict = {}
    for name, w in model.state_dict().items():
        weights.update(quantize.convert({name: w}) if name.endswith("proj.weight") else {name: w})
    os.makedirs(d)
    half = len(weights) // 2             # two shards and an index, as real checkpoints come
    names = sorted(weights)
    for i, part in enumerate((names[:half], names[half:])):
        save_file({n: weights[n].contiguous() for n in part}, str(d / f"model-0000{i + 1}-of-00002.safetensors"),
                  metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f"model-0000{1 + (n in names[half:])}-of-00002.safetensors"
                                            for n in names}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    config_dict = config.to_dict()
    config_dict["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128],
                                          "activation_scheme": "dynamic"}
    (d / "config.json").write_text(json.dumps(config_dict))
    return weights


def test_an_fp8_checkpoint_arrives_byte_for_byte_and_loads_with_transformers(tmp_path):
    pytest.importorskip("accelerate", reason="transformers loads FP8 checkpoints through accelerate")
    from safetensors.torch import load_file

    src, out = tmp_path / "llama-fp8", tmp_path / "received"
    weights = fp8_model_dir(src)
    assert sum(n.endswith("weight_scale_inv") for n in weights) == 14
    names = sorted(os.listdir(src))
    recv, where = start_recv(out, "--once")
    rc_s, _, err_s = finish(cli("send", str(src), "--to", where, "--verify", "--json"), timeout=60)
    rc_r, _, err_r = finish(recv, timeout=60)
    assert rc_s == 0, err_s
    assert rc_r == 0, err_r
    assert sorted(os.listdir(out)) == names
    for n in names:
        assert sha(src / n) == sha(out / n), n
    got = {}
    for n in names:
        if n.endswith(".safetensors"):
            got.update(load_file(str(out / n)))
    assert got.keys() == weights.keys()
    assert all(got[n].dtype == weights[n].dtype for n in got)
    assert got["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    # from_safetensors holds the same bytes in one region, FP8 values and scales in their own dtypes
    import tensorxfer as tx

    with tx.TensorRegion.from_safetensors(src) as region:
        views = region.tensors(framework="torch")
        assert all(views[n].dtype == w.dtype and torch.equal(views[n].view(torch.uint8), w.view(torch.uint8))
                   for n, w in weights.items())
        del views
    # transformers loads both (on a host without a GPU it dequantizes them to bf16): the same model
    ids = torch.tensor([[5, 17, 33, 2, 71, 8, 40, 91]])
    logits = []
    for d in (src, out):
        model = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
        with torch.no_grad():
            logits.append(model(ids).logits)
    assert torch.equal(logits[0], logits[1])
