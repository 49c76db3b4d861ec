"""Imports that refuse broken files (issue 20, class 2): each one a UserError, one line, before loading.

A GPT-2 directory is made here by andrea's own save_pretrained (no transformers needed), then
broken the ways downloads and hand edits break it: config.json values of the wrong type and
fractional sizes; an empty, truncated or malformed-header model.safetensors; a sharded index naming
a missing shard; NaN and infinite weights; a tokenizer.json with an empty vocabulary. Each must be
refused by `ANDREA.from_pretrained` (or the tokenizer loader) with a message naming the file, and
`train --init-from` must exit 2 with one line and no traceback.
"""

import json
import math

import numpy as np
import pytest
import safetensors.numpy
from test_train import STDLIB_JSON, run_main

from andrea.config import ModelConfig
from andrea.data.tokenizer import Tokenizer, load_tokenizer
from andrea.errors import UserError
from andrea.interop import hf
from andrea.model.transformer import ANDREA

CFG = ModelConfig(vocab_size=300, context_length=16, d_model=8, n_layer=1, n_head=2)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train([p.read_text() for p in sorted(STDLIB_JSON.glob("*.py"))], CFG.vocab_size,
                           allow_smaller=True)


@pytest.fixture
def gpt2(tmp_path, tok):
    """A complete, loadable GPT-2 directory, fresh for each test to break."""
    cfg = ModelConfig(**{**CFG.__dict__, "vocab_size": tok.vocab_size})
    directory = tmp_path / "gpt2"
    ANDREA(cfg, device="cpu", seed=1).save_pretrained(directory, tokenizer=tok)
    ANDREA.from_pretrained(directory)  # whole before it is broken
    return directory


def refused(directory, *match):
    with pytest.raises(UserError) as e:
        ANDREA.from_pretrained(directory)
    message = str(e.value)
    assert "\n" not in message and all(m in message for m in match), message
    return message


def edit_config(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("key, value, says", [
    ("n_layer", 1.5, "n_layer must be a whole number of at least 1, got 1.5"),
    ("n_layer", "2", 'n_layer must be a whole number of at least 1, got "2"'),
    ("n_embd", None, "n_embd must be a whole number"),
    ("n_head", [2], "n_head must be a whole number"),
    ("n_head", True, "n_head must be a whole number"),
    ("vocab_size", 0, "vocab_size must be a whole number of at least 1, got 0"),
    ("n_inner", 2.5, "n_inner must be a whole number"),
    ("layer_norm_epsilon", "1e-5", "layer_norm_epsilon must be a positive finite number"),
    ("layer_norm_epsilon", -1, "layer_norm_epsilon must be a positive finite number"),
    ("activation_function", ["gelu_new"], "activation_function must be a string"),
    ("tie_word_embeddings", "yes", "tie_word_embeddings must be true or false"),
    ("n_head", 3, "must be divisible"),
])
def test_config_values_of_the_wrong_type_or_size_are_refused(gpt2, key, value, says):
    edit_config(gpt2, **{key: value})
    refused(gpt2, "config.json", says)


def test_a_config_beyond_its_weights_is_refused_before_anything_is_allocated(gpt2, monkeypatch):
    edit_config(gpt2, n_embd=2**20, n_head=1, n_layer=10**4)  # a 10^16-parameter model: never built
    monkeypatch.setattr(ANDREA, "__init__", lambda *a, **k: pytest.fail("the model was built"))
    refused(gpt2, "do not fit its config.json")


def write_header(path, header, data=b""):
    blob = json.dumps(header).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + data)


@pytest.mark.parametrize("damage, says", [
    ("empty", "it has 0 bytes"),
    ("seven bytes", "it has 7 bytes"),
    ("truncated mid-data", "is cut short"),
    ("truncated mid-header", "its header claims"),
    ("header not JSON", "its header is not JSON"),
    ("header a list", "its header is not a JSON object"),
    ("entry without offsets", "lacks a dtype, shape or data_offsets"),
    ("negative shape", "malformed shape"),
    ("offsets that disagree with the shape", "do not hold a [2, 2] F32 tensor"),
    ("integer weights", "andrea reads floating-point weights"),
])
def test_damaged_safetensors_are_refused_naming_the_file(gpt2, damage, says):
    weights = gpt2 / hf.WEIGHTS
    blob = weights.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    if damage == "empty":
        weights.write_bytes(b"")
    elif damage == "seven bytes":
        weights.write_bytes(blob[:7])
    elif damage == "truncated mid-data":
        weights.write_bytes(blob[:8 + n + 10])
    elif damage == "truncated mid-header":
        weights.write_bytes(blob[:8 + n // 2])
    elif damage == "header not JSON":
        weights.write_bytes(blob[:8] + b"{" * n + blob[8 + n:])
    elif damage == "header a list":
        write_header(weights, [1, 2])
    elif damage == "entry without offsets":
        write_header(weights, {"w": {"dtype": "F32", "shape": [2, 2]}}, bytes(16))
    elif damage == "negative shape":
        write_header(weights, {"w": {"dtype": "F32", "shape": [-2, 2], "data_offsets": [0, 16]}}, bytes(16))
    elif damage == "offsets that disagree with the shape":
        write_header(weights, {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}, bytes(16))
    elif damage == "integer weights":
        write_header(weights, {"w": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]}}, bytes(16))
    refused(gpt2, str(weights), says)


def test_a_sharded_index_naming_a_missing_shard_is_refused(gpt2):
    tensors = hf.read_safetensors(gpt2 / hf.WEIGHTS)
    names = sorted(tensors)
    half = {n: np.ascontiguousarray(tensors[n]) for n in names[: len(names) // 2]}
    safetensors.numpy.save_file(half, str(gpt2 / "model-00001-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in half}
    weight_map.update({n: "model-00002-of-00002.safetensors" for n in names[len(names) // 2:]})
    (gpt2 / hf.WEIGHTS_INDEX).write_text(json.dumps({"weight_map": weight_map}))
    (gpt2 / hf.WEIGHTS).unlink()
    refused(gpt2, "model-00002-of-00002.safetensors", "is not in", "download the missing files")
    (gpt2 / hf.WEIGHTS_INDEX).write_text(json.dumps({"weight_map": ["a list"]}))
    refused(gpt2, "has no weight_map")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_non_finite_weights_are_refused(gpt2, bad, dtype):
    tensors = {n: np.array(a, dtype=dtype) for n, a in hf.read_safetensors(gpt2 / hf.WEIGHTS).items()}
    tensors["transformer.h.0.mlp.c_fc.weight"][1, 2] = bad
    safetensors.numpy.save_file(tensors, str(gpt2 / hf.WEIGHTS))
    refused(gpt2, "transformer.h.0.mlp.c_fc.weight holds 1 ", "NaN" if math.isnan(bad) else "infinite")


def test_a_tokenizer_with_an_empty_vocabulary_is_refused(tmp_path):
    from tokenizers import AddedToken, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    t = HFTokenizer(models.BPE(vocab={}, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    for name, special in (("empty.json", []), ("only_eot.json", ["<|endoftext|>"])):
        t.add_special_tokens([AddedToken(s, special=True) for s in special])
        t.save(str(tmp_path / name))
        with pytest.raises(UserError, match="lacks 256 of the 256 byte-level symbols"):
            load_tokenizer(tmp_path / name)


@pytest.mark.parametrize("damage", ["config", "weights", "nan"])
def test_train_init_from_a_broken_directory_is_one_line_exit_2(gpt2, tmp_path, capsys, damage):
    if damage == "config":
        edit_config(gpt2, n_layer=1.5)
    elif damage == "weights":
        (gpt2 / hf.WEIGHTS).write_bytes(b"")
    else:
        tensors = {n: np.array(a) for n, a in hf.read_safetensors(gpt2 / hf.WEIGHTS).items()}
        tensors["transformer.wte.weight"][0, 0] = math.nan
        safetensors.numpy.save_file(tensors, str(gpt2 / hf.WEIGHTS))
    cfg = tmp_path / "ft.yaml"
    cfg.write_text(json.dumps({
        "train": {"batch_size": 2, "seq_len": 8, "max_steps": 2, "sample_tokens": 0, "device": "cpu"},
        "data": {"inputs": [str(STDLIB_JSON)], "data_dir": str(tmp_path / "data")},
    }))
    assert run_main(["--config", str(cfg), "--init-from", str(gpt2), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("error: ") and "Traceback" not in err
