"""The Hugging Face format both ways, checked against transformers itself (no network: every model
is a small random GPT-2 built and saved here): transformers' GPT-2 -> andrea with equal logits,
andrea's checkpoint -> export -> transformers with equal logits and token ids, the refusals, and a
fine-tune from an imported directory that is exported again.
"""

import json
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from optional import require

from andrea.config import ModelConfig, build_config
from andrea.data.tokenizer import Tokenizer, load_tokenizer
from andrea.errors import UserError
from andrea.export import main as export_main
from andrea.interop import hf
from andrea.model.transformer import ANDREA
from andrea.run import checkpoint as ckpt

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the network
STDLIB_JSON = Path(json.__file__).parent
TEXTS = [
    "def f(x):\n    return x ** 2  # squares\n",
    "naïve café, 世界, emoji 🎉 and \u00a0 no-break space",
    "a literal <|endoftext|> inside text is text",
    "<|endoftext|>",
    "\t\ttabs,\r\nCRLF and   runs   of spaces  \n\n",
    "",
]


@pytest.fixture(scope="module")
def tok():
    texts = [p.read_text() for p in sorted(STDLIB_JSON.glob("*.py"))]
    return Tokenizer.train(texts, 700, allow_smaller=True)


def random_gpt2(transformers, torch, directory, seed=0, **shape):
    """A transformers GPT-2 with random weights (biases and LayerNorms too), saved to `directory`."""
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(bos_token_id=0, eos_token_id=0, **shape)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(directory)
    return model


def hf_logits(torch, model, idx):
    with torch.no_grad():
        return model(torch.tensor(idx)).logits.numpy()


# ----------------------------------------------------------------------------- transformers -> andrea


@pytest.mark.parametrize("shape", [
    dict(vocab_size=300, n_positions=32, n_embd=16, n_layer=2, n_head=2),
    dict(vocab_size=1001, n_positions=17, n_embd=24, n_layer=1, n_head=3, n_inner=40),
    dict(vocab_size=50257, n_positions=8, n_embd=8, n_layer=3, n_head=1, layer_norm_epsilon=1e-6),
])
def test_from_pretrained_reads_transformers_gpt2_with_equal_logits(tmp_path, shape):
    torch, transformers = require("torch"), require("transformers")
    reference = random_gpt2(transformers, torch, tmp_path, **shape)
    idx = np.random.default_rng(0).integers(0, shape["vocab_size"], (2, shape["n_positions"]))
    expected = hf_logits(torch, reference, idx)
    model = ANDREA.from_pretrained(tmp_path, dtype="float32")
    assert model.cfg.vocab_size == shape["vocab_size"] and model.cfg.context_length == shape["n_positions"]
    assert model.cfg.mlp_dim == shape.get("n_inner", 4 * shape["n_embd"])
    np.testing.assert_allclose(model.logits(idx), expected, rtol=0, atol=2e-6 * np.abs(expected).max())
    # float64 from float32 weights: the remaining difference is transformers' float32 arithmetic
    np.testing.assert_allclose(ANDREA.from_pretrained(tmp_path, dtype="float64").logits(idx), expected,
                               rtol=0, atol=2e-6 * np.abs(expected).max())


@pytest.mark.parametrize("setting, value, named", [
    ("activation_function", "relu", "activation_function 'relu'"),
    ("tie_word_embeddings", False, "tie_word_embeddings false"),
    ("scale_attn_weights", False, "scale_attn_weights false"),
    ("scale_attn_by_inverse_layer_idx", True, "scale_attn_by_inverse_layer_idx true"),
    ("reorder_and_upcast_attn", True, "reorder_and_upcast_attn true"),
    ("add_cross_attention", True, "add_cross_attention true"),
    ("model_type", "llama", "andrea reads GPT-2"),
])
def test_configurations_andrea_lacks_are_refused_by_name(tmp_path, setting, value, named):
    config = hf.hf_config(ModelConfig(vocab_size=50, context_length=8, d_model=8, n_layer=1, n_head=2), 49, "float32")
    config[setting] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=named):
        ANDREA.from_pretrained(tmp_path)


def test_tanh_gelu_under_either_name_is_accepted():
    base = hf.hf_config(ModelConfig(vocab_size=50, context_length=8, d_model=8, n_layer=1, n_head=2), 49, "float32")
    for name in ("gelu_new", "gelu_pytorch_tanh"):
        assert hf.model_config_from_hf({**base, "activation_function": name}, "x").d_model == 8


def test_pickled_weights_are_refused_with_the_conversion(tmp_path):
    cfg = ModelConfig(vocab_size=50, context_length=8, d_model=8, n_layer=1, n_head=2)
    (tmp_path / "config.json").write_text(json.dumps(hf.hf_config(cfg, 49, "float32")))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04 a pickle, never opened")
    with pytest.raises(UserError, match="pytorch_model.bin, a pickle") as e:
        ANDREA.from_pretrained(tmp_path)
    assert "save_pretrained" in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "pytorch_model.bin").unlink()
    with pytest.raises(UserError, match="no model.safetensors"):
        ANDREA.from_pretrained(tmp_path)


def test_weights_of_old_and_bare_gpt2_saves_and_untied_heads():
    wte = np.ones((4, 2), np.float32)
    state = hf.gpt2_state({"wte.weight": wte, "h.0.attn.bias": np.ones((1, 1, 4, 4)),
                           "h.0.attn.c_attn.bias": np.zeros(6), "lm_head.weight": wte.copy()}, "x")
    assert sorted(state) == ["transformer.h.0.attn.c_attn.bias", "transformer.wte.weight"]
    with pytest.raises(UserError, match="untied output head"):
        hf.gpt2_state({"transformer.wte.weight": wte, "lm_head.weight": 2 * wte}, "x")


def test_half_precision_safetensors_are_read(tmp_path):
    torch, safetensors_torch = require("torch"), pytest.importorskip("safetensors.torch")
    x = torch.randn(3, 5)
    safetensors_torch.save_file({"a": x.bfloat16(), "b": x.half()}, tmp_path / "w.safetensors")
    read = hf.read_safetensors(tmp_path / "w.safetensors")
    np.testing.assert_array_equal(read["a"], x.bfloat16().float().numpy())
    np.testing.assert_array_equal(read["b"], x.half().numpy())


# ----------------------------------------------------------------------------- andrea -> transformers


def checkpoint_run(tmp_path, tok, seed=3):
    """A run directory holding one checkpoint of a small model with non-trivial weights."""
    config = build_config({"model": {"vocab_size": tok.vocab_size, "context_length": 24, "d_model": 32,
                                     "n_layer": 2, "n_head": 4}})
    model = ANDREA(config.model, seed=seed)
    rng = np.random.default_rng(seed)
    for _, view in model.named_parameters():
        view += rng.normal(0, 0.05, view.shape).astype(view.dtype)
    run = tmp_path / "run"
    ckpt.save_checkpoint(run, 7, model.state_dict(), {"config": config.to_dict(), "step": 7,
                                                      "tokenizer_fingerprint": tok.fingerprint()})
    tok.save(run / "tokenizer.json")
    return run, model


def test_export_loads_in_transformers_with_equal_logits_and_ids(tmp_path, tok):
    torch, transformers = require("torch"), require("transformers")
    run, model = checkpoint_run(tmp_path, tok)
    out = tmp_path / "export"
    assert export_main(["--checkpoint", str(run), "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["activation_function"] == "gelu_new" and config["tie_word_embeddings"] is True
    assert config["bos_token_id"] == config["eos_token_id"] == tok.eot_id

    reference = transformers.AutoModelForCausalLM.from_pretrained(out)
    idx = np.random.default_rng(1).integers(0, tok.vocab_size, (3, 24))
    expected = model.logits(idx)
    np.testing.assert_allclose(hf_logits(torch, reference, idx), expected, rtol=0,
                               atol=2e-6 * np.abs(expected).max())

    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok.is_fast and hf_tok.eos_token_id == tok.eot_id and hf_tok.decode([tok.eot_id]) == "<|endoftext|>"
    for text in TEXTS:
        ids = tok.encode(text)
        assert hf_tok(text)["input_ids"] == ids, text
        assert tok.eot_id not in ids  # andrea's rule: a literal <|endoftext|> is text, in transformers too
        assert hf_tok.decode(ids) == text

    # and back: andrea reads its own export bit for bit, tokenizer included
    again = ANDREA.from_pretrained(out)
    assert all(np.array_equal(again.state_dict()[k], v) for k, v in model.state_dict().items())
    assert all(load_tokenizer(out).encode(t) == tok.encode(t) for t in TEXTS)


@pytest.fixture(scope="module")
def exported_tokenizer(tmp_path_factory, tok):
    """transformers' AutoTokenizer over andrea's exported tokenizer files."""
    transformers = require("transformers")
    out = tmp_path_factory.mktemp("tokenizer-only")
    for name, blob in hf.tokenizer_files(tok, 64).items():
        (out / name).write_bytes(blob)
    return transformers.AutoTokenizer.from_pretrained(out)


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40))
def test_exported_tokenizer_gives_andreas_ids_for_any_text(exported_tokenizer, tok, text):
    hf_tok = exported_tokenizer
    try:
        ids = tok.encode(text)
    except UserError:  # a lone surrogate: UTF-8 cannot hold it
        return
    assert hf_tok(text)["input_ids"] == ids
    assert hf_tok.decode(ids) == text == tok.decode(ids)


# ----------------------------------------------------------------------------- foreign tokenizers


def foreign_tokenizer(directory, texts, vocab_size=400, transformers=None):
    """A HF byte-level BPE not laid out as andrea's: <|endoftext|> at id 0, or, saved by transformers'
    GPT2Tokenizer when `transformers` is given, at the end as in GPT-2. Returns its vocabulary size."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    t = HFTokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    special = [] if transformers else ["<|endoftext|>"]
    t.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                     show_progress=False))
    if transformers is None:
        t.save(str(directory / "tokenizer.json"))
        return t.get_vocab_size()
    model = json.loads(t.to_str())["model"]
    vocab = {**model["vocab"], "<|endoftext|>": len(model["vocab"])}
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    transformers.GPT2Tokenizer(vocab=vocab, merges=merges).save_pretrained(directory)
    return len(vocab)


def test_a_foreign_tokenizer_encodes_and_decodes_as_andrea_does(tmp_path, tok):
    texts = [p.read_text() for p in sorted(STDLIB_JSON.glob("*.py"))]
    vocab = foreign_tokenizer(tmp_path, texts)
    t = load_tokenizer(tmp_path)
    assert t.eot_id == 0 and t.vocab_size == vocab
    for text in TEXTS:
        ids = t.encode(text)
        assert 0 not in ids and t.decode(ids) == text
        assert "".join(t.token_bytes(i).decode("latin-1") for i in ids).encode("latin-1") == text.encode()
    assert t.decode([0]) == "<|endoftext|>"
    t.save(tmp_path / "copy.json")
    assert load_tokenizer(tmp_path / "copy.json").fingerprint() == t.fingerprint()


def test_tokenizers_beyond_uint16_and_not_byte_level_are_refused(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    symbols = [chr(c) for c in range(0x21, 0x7F)] + [chr(c) for c in range(0x100, 0x100 + 200)]
    vocab = {a + b: i for i, (a, b) in enumerate((a, b) for a in symbols for b in symbols)}
    assert len(vocab) > 65536
    big = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    big.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    big.save(str(tmp_path / "big.json"))
    with pytest.raises(UserError, match="uint16"):
        load_tokenizer(tmp_path / "big.json")
    word_level = HFTokenizer(models.WordLevel(vocab={"a": 0, "<unk>": 1}, unk_token="<unk>"))
    word_level.save(str(tmp_path / "wl.json"))
    with pytest.raises(UserError, match="not a byte-level BPE"):
        load_tokenizer(tmp_path / "wl.json")


# ----------------------------------------------------------------------------- fine-tuning


def run_train(argv):
    from andrea.cli import run_cli
    from andrea.train import main

    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, argv)
    return exit_info.value.code


def test_fine_tune_from_transformers_gpt2_then_export(tmp_path, capsys):
    """transformers' GPT-2 and GPT2Tokenizer, saved by transformers -> andrea.train --init-from -> export ->
    transformers again."""
    torch, transformers = require("torch"), require("transformers")
    from andrea.data.loader import BatchLoader
    from andrea.data.manifest import open_split
    from andrea.train import main as train_main  # noqa: F401 (the entry point under test, via run_train)

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    texts = [p.read_text() for p in sorted(STDLIB_JSON.glob("*.py"))]
    vocab = foreign_tokenizer(gpt2, texts, transformers=transformers)
    reference = random_gpt2(transformers, torch, gpt2, vocab_size=vocab, n_positions=32, n_embd=16, n_layer=2,
                            n_head=2)
    cfg = tmp_path / "ft.yaml"
    cfg.write_text(json.dumps({
        "train": {"batch_size": 4, "seq_len": 16, "max_steps": 6, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 0,
                  "log_interval": 1, "eval_interval": 3, "eval_batches": 2, "checkpoint_interval": 3,
                  "sample_tokens": 5, "device": "cpu"},
        "data": {"inputs": [str(STDLIB_JSON)], "data_dir": str(tmp_path / "data")},
    }))
    out = tmp_path / "run"
    base = ["--config", str(cfg), "--init-from", str(gpt2)]
    assert run_train([*base, "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert f"initialised from {gpt2}" in printed.out

    # step 1's loss is transformers' loss of the imported weights on the first batch
    tok = load_tokenizer(tmp_path / "data")
    assert tok.fingerprint() == load_tokenizer(gpt2).fingerprint() == load_tokenizer(out).fingerprint()
    tokens = open_split(tmp_path / "data", "train", vocab, tok.fingerprint())
    x, y = BatchLoader(tokens, 4, 16, seed=0).next_batch()
    logp = torch.log_softmax(torch.tensor(hf_logits(torch, reference, x), dtype=torch.float64), -1).numpy()
    expected = -np.take_along_axis(logp, y[..., None], -1).mean()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 1 and abs(rows[0]["loss"] - expected) < 1e-5
    assert rows[-1]["step"] == 6 and rows[-1]["loss"] < rows[0]["loss"]

    exported = tmp_path / "export"
    assert export_main(["--checkpoint", str(out), "--out", str(exported)]) == 0
    tuned = transformers.AutoModelForCausalLM.from_pretrained(exported)
    mine = ANDREA.from_pretrained(exported)
    np.testing.assert_allclose(hf_logits(torch, tuned, x), mine.logits(x), rtol=0, atol=1e-5)
    assert not np.allclose(hf_logits(torch, tuned, x), hf_logits(torch, reference, x))
    hf_tok = transformers.AutoTokenizer.from_pretrained(exported)
    assert hf_tok.eos_token_id == tok.eot_id == vocab - 1
    assert all(hf_tok(t)["input_ids"] == tok.encode(t) for t in TEXTS)

    # the model's shape comes from the directory: a --set model.* that disagrees is refused
    assert run_train([*base, "--out", str(tmp_path / "r2"), "--set", "model.d_model=32"]) == 2
    assert "model.d_model=32 conflicts" in capsys.readouterr().err
    assert run_train([*base, "--out", str(out), "--resume"]) == 2
    assert "give only one" in capsys.readouterr().err


def test_prepare_with_a_given_tokenizer_refuses_to_mix_tokenizers(tmp_path):
    from andrea.data.preparation import prepare

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    foreign_tokenizer(gpt2, [p.read_text() for p in sorted(STDLIB_JSON.glob("*.py"))])
    stats = prepare([str(STDLIB_JSON)], tmp_path / "d", progress=False, tokenizer=gpt2)
    assert stats["tokenizer"] == f"given: {gpt2}" and stats["vocab_size"] == load_tokenizer(gpt2).vocab_size
    assert prepare([str(STDLIB_JSON)], tmp_path / "d", progress=False, tokenizer=gpt2)["skipped"]
    prepare([str(STDLIB_JSON)], tmp_path / "d2", progress=False, allow_smaller_vocab=True)  # andrea's own
    with pytest.raises(UserError, match="already holds another tokenizer"):
        prepare([str(STDLIB_JSON)], tmp_path / "d2", progress=False, tokenizer=gpt2)


def test_a_gpt2_with_a_padded_vocabulary_fine_tunes_samples_and_exports(tmp_path, capsys):
    """issue 30, class 9: a GPT-2 whose config.json's vocab_size is larger than its tokenizer's (GPT-2-class
    checkpoints round it up) was refused by --init-from, with advice (model.vocab_size=N) that --init-from
    then refused too; transformers' from_pretrained loads it."""
    torch, transformers = require("torch"), require("transformers")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    n = foreign_tokenizer(gpt2, [p.read_text() for p in sorted(STDLIB_JSON.glob("*.py"))], transformers=transformers)
    random_gpt2(transformers, torch, gpt2, vocab_size=n + 7, n_positions=16, n_embd=8, n_layer=1, n_head=2)
    cfg = tmp_path / "ft.yaml"
    cfg.write_text(json.dumps({
        "train": {"batch_size": 2, "max_steps": 2, "warmup_steps": 0, "log_interval": 1, "eval_interval": 2,
                  "eval_batches": 1, "checkpoint_interval": 2, "sample_tokens": 0, "device": "cpu"},
        "data": {"inputs": [str(STDLIB_JSON)], "data_dir": str(tmp_path / "data")}}))
    out = tmp_path / "run"
    assert run_train(["--config", str(cfg), "--init-from", str(gpt2), "--out", str(out)]) == 0, capsys.readouterr().err
    assert f"model.vocab_size {n + 7} pads the tokenizer's {n} ids" in capsys.readouterr().err
    assert run_train(["--out", str(out), "--resume", "--max-steps", "3"]) == 0
    assert export_main(["--checkpoint", str(out), "--out", str(tmp_path / "export")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert back.config.vocab_size == n + 7 and len(transformers.AutoTokenizer.from_pretrained(tmp_path / "export")) == n


def test_sampling_never_draws_the_ids_a_padded_vocabulary_adds():
    from andrea.config import ModelConfig
    from andrea.sample import generate

    model = ANDREA(ModelConfig(vocab_size=20, context_length=8, d_model=8, n_layer=1, n_head=2), seed=0)
    model.wte.W[15:] = 10.0 * model.wte.W[:5].sum(0)  # the padded rows would win every draw
    drawn = list(generate(model, [1, 2], 30, temperature=1.0, seed=0, n_ids=15))
    assert len(drawn) == 30 and max(drawn) < 15
    assert max(generate(model, [1, 2], 30, temperature=1.0, seed=0)) >= 15  # which they do without n_ids
