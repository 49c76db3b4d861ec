"""andrea.trace, one token through the model, checked against the model's layers run here by hand
and against an attention written out in float64: the residual norms and LayerNorm statistics it
prints are those of the layers, its attention rows are distributions over the past only, its
hooks change nothing (a block's trace is its `infer` to the bit), and the logit lens of the last
block is the model's own output distribution (andrea's generation path, and transformers' for an
imported GPT-2). On a tiny model trained a few steps and a tiny random GPT-2.
"""

import contextlib
import io
import math
import re
import sys

import numpy as np
import pytest
from optional import require
from runs import tiny_run

from andrea import trace
from andrea.cli import run_cli
from andrea.config import ModelConfig
from andrea.model.block import NORMS
from andrea.model.transformer import ANDREA
from minitensor.device import to_numpy

PROMPT = "def loads(s, *, cls=None):\n    return"


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_dir):
    return tiny_run(tmp_path_factory.mktemp("trace"), data_dir)


def call(argv):
    """(exit code, stdout, stderr) of python -m andrea.trace argv, in process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        run_cli(trace.main, argv)
    return e.value.code, out.getvalue(), err.getvalue()


def parse(printed):
    """{block: {"norms": [3], "ln_1": [2], "ln_2": [2], "attn": float, "mlp": float, "heads": [[(pos, p)]],
    "lens": line}} and the output line, from the printed trace."""
    blocks, cur = {}, None
    for line in printed.splitlines():
        if m := re.fullmatch(r"block (\d+)", line):
            cur = blocks[int(m[1])] = {"heads": []}
        elif line.startswith("  residual |x|"):
            cur["norms"] = [float(v) for v in re.findall(r"(?:in|attention|MLP) (\S+)", line)]
        elif m := re.match(r"  (ln_[12]) +mean (\S+) \| rstd (\S+)", line):
            cur[m[1]] = [float(m[2]), float(m[3])]
        elif m := re.match(r"  (attention|MLP) +\|delta\| (\S+)", line):
            cur["attn" if m[1] == "attention" else "mlp"] = float(m[2])
        elif line.startswith("    head"):
            cur["heads"].append([(int(p), float(v)) for p, v in re.findall(r"@(\d+) .*? (\d\.\d{3})(?= \||$)", line)])
        elif line.startswith("  logit lens"):
            cur["lens"] = line.split("logit lens", 1)[1].strip()
    output = next(line for line in printed.splitlines() if line.startswith("output"))
    return blocks, output


def by_hand(model, ids):
    """Each block's (x, x1, x2, ln_1 input, ln_2 input) for ids, from the layers' own infer paths,
    and each block's attention probabilities written out in float64 from its weights."""
    x = model.wte.W[np.array([ids])] + model.wpe.W[:len(ids)]
    rows, probs = [], []
    C, nh = model.cfg.d_model, model.cfg.n_head
    hs, T = C // nh, len(ids)
    for block, kv in zip(model.blocks, model.new_kv_cache(1)):
        h = block.ln_1.infer(x)
        x1 = block.attn.forward_kv(h, kv, 0, residual=x)
        x2 = block.mlp.infer(block.ln_2.infer(x1), residual=x1)
        rows.append((x, x1, x2))
        qkv = np.asarray(h[0], np.float64) @ block.attn.c_attn.W.astype(np.float64) + block.attn.c_attn.b
        q, k = (qkv[:, i * C:(i + 1) * C].reshape(T, nh, hs).transpose(1, 0, 2) for i in (0, 1))
        s = q @ k.transpose(0, 2, 1) / math.sqrt(hs) + np.triu(np.full((T, T), -np.inf), 1)
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        probs.append(e / e.sum(axis=-1, keepdims=True))                     # (nh, T, T)
        x = x2
    return rows, probs


def test_the_printed_trace_is_what_the_layers_compute(run):
    code, out, err = call(["--checkpoint", str(run), "--prompt", PROMPT])
    assert code == 0, err
    blocks, output = parse(out)
    model, tokenizer, _, _ = trace.load_any(run)
    ids = tokenizer.encode(PROMPT)
    t = len(ids) - 1
    rows, probs = by_hand(model, ids)
    assert sorted(blocks) == list(range(model.cfg.n_layer))
    for i, ((x, x1, x2), p) in enumerate(zip(rows, probs)):
        b = blocks[i]
        expected = [np.linalg.norm(np.float64(a[0, t])) for a in (x, x1, x2)]
        np.testing.assert_allclose(b["norms"], expected, rtol=1e-5, atol=6e-5)
        np.testing.assert_allclose(b["attn"], np.linalg.norm(np.float64(x1[0, t] - x[0, t])), rtol=1e-4, atol=6e-5)
        np.testing.assert_allclose(b["mlp"], np.linalg.norm(np.float64(x2[0, t] - x1[0, t])), rtol=1e-4, atol=6e-5)
        for name, a in (("ln_1", x), ("ln_2", x1)):
            row = np.float64(a[0, t])
            stats = [row.mean(), 1 / math.sqrt(row.var() + model.cfg.ln_eps)]
            np.testing.assert_allclose(b[name], stats, rtol=1e-4, atol=6e-5)
        assert len(b["heads"]) == model.cfg.n_head
        for h, shown in enumerate(b["heads"]):
            best = np.sort(p[h, t])[::-1][:trace.ATTENTION_TOP]
            np.testing.assert_allclose([v for _, v in shown], best, atol=6e-4)
            for pos, v in shown:
                assert abs(p[h, t, pos] - v) <= 6e-4
    # the last block's logit lens is the model's output line: its top token, and its probabilities as printed
    lens, own = (re.findall(r"('.*?'|\".*?\") (\d\.\d{3})", line) for line in
                 (blocks[model.cfg.n_layer - 1]["lens"], output.split("  (the model")[0]))
    assert len(lens) == len(own) == 5 and lens[0][0] == own[0][0]
    np.testing.assert_allclose([float(p) for _, p in lens], [float(p) for _, p in own], atol=1.5e-3)


def test_attention_rows_are_distributions_over_the_past_and_the_lens_ends_at_the_output(run):
    model, tokenizer, _, _ = trace.load_any(run)
    ids = tokenizer.encode(PROMPT)
    T = len(ids)
    future = np.triu(np.ones((T, T), bool), 1)
    steps = model.trace(np.array([ids]))
    for step in steps:
        p = to_numpy(step["probs"])[0]                                     # (nh, T, T)
        np.testing.assert_allclose(p.sum(axis=-1), 1, atol=1e-6)
        assert (p >= 0).all() and (p[:, future] == 0).all()
    for t in (0, T // 2, T - 1):
        blocks = trace.trace(model, ids, t)
        assert blocks[0].attention.shape == (model.cfg.n_head, t + 1)
        np.testing.assert_array_equal(blocks[0].attention, to_numpy(steps[0]["probs"])[0, :, t, :t + 1])
        # the model's generation path on ids[:t + 1], and its training forward: the same distribution
        # to float32 rounding (the products differ in shape: T rows here, t + 1 or 1 there)
        np.testing.assert_allclose(blocks[-1].lens, trace.model_output(model, ids, t), rtol=1e-5, atol=1e-9)
        training = trace.softmax(model.logits(np.array([ids[:t + 1]]))[0, t])
        np.testing.assert_allclose(blocks[-1].lens, training, rtol=1e-4, atol=1e-9)
        assert np.isclose(blocks[-1].lens.sum(), 1) and blocks[-1].lens_top1[t][0] == int(np.argmax(blocks[-1].lens))
    assert (trace.trace(model, ids, 0)[0].attention == 1).all()  # the first token sees itself alone


@pytest.mark.parametrize("variant", [{}, {"norm_position": "post"}, {"residual": False},
                                     {"norm_position": "post", "residual": False}, {"activation": "relu"},
                                     {"activation": "swiglu"}, {"norm_position": "none"},
                                     {"norm_position": "none", "residual": False},
                                     *({"norm": kind, "norm_position": position} for kind in NORMS
                                       if kind != "layernorm" for position in ("pre", "post"))])
def test_a_blocks_trace_is_its_infer_to_the_bit(variant):
    """The hooks (each norm's infer_stats, forward_kv's record) change nothing: Block.trace's x2 is
    Block.infer's, and its deltas and stream add up as the block's formula says."""
    cfg = ModelConfig(vocab_size=50, context_length=12, d_model=12, n_layer=2, n_head=3, **variant)
    model = ANDREA(cfg, seed=1)
    rng = np.random.default_rng(0)
    for _, view in model.named_parameters():
        view += rng.normal(0, 0.1, view.shape).astype(view.dtype)
    x = rng.normal(0, 1, (2, 7, 12)).astype(np.float32)
    for block in model.blocks:
        kv_a, kv_b = model.new_kv_cache(2)[0], model.new_kv_cache(2)[0]
        t = block.trace(x, kv_a, 0)
        np.testing.assert_array_equal(t["x2"], block.infer(x, kv_b, 0))
        np.testing.assert_array_equal(kv_a[0], kv_b[0])
        if cfg.norm_position == "pre":
            np.testing.assert_array_equal(t["x1"], x + t["attn"] if cfg.residual else t["attn"])
            assert list(t["ln_1"]) == list(NORMS[cfg.norm].stats)
            if cfg.norm == "layernorm":
                mean, rstd = t["ln_1"]["mean"], t["ln_1"]["rstd"]
                h = block.ln_1.infer(x)
                np.testing.assert_allclose((x - mean) * rstd * block.ln_1.w + block.ln_1.b, h, rtol=1e-5, atol=1e-5)
        elif cfg.norm_position == "none":
            assert t["ln_1"] == {} and t["ln_2"] == {}
        assert t["probs"].shape == (2, 3, 7, 7)
        x = t["x2"]
    ids = rng.integers(0, 50, (1, 9))
    steps = model.trace(ids)
    logits = model.head.infer(model.ln_f.infer(steps[-1]["x2"][:, -1]))
    np.testing.assert_array_equal(logits, model.forward_kv(ids, model.new_kv_cache(1), 0))


def test_an_imported_gpt2_is_traced_and_its_lens_ends_at_transformers_output(tmp_path):
    torch, transformers = require("torch"), require("transformers")
    from test_hf import STDLIB_JSON, foreign_tokenizer, random_gpt2

    texts = [p.read_text() for p in sorted(STDLIB_JSON.glob("*.py"))]
    V = foreign_tokenizer(tmp_path, texts, 400, transformers)
    reference = random_gpt2(transformers, torch, tmp_path, vocab_size=V, n_positions=32, n_embd=16, n_layer=2,
                            n_head=2)
    code, out, err = call(["--checkpoint", str(tmp_path), "--prompt", PROMPT, "--position", "-3"])
    assert code == 0, err
    assert "Hugging Face GPT-2" in out and sorted(parse(out)[0]) == [0, 1]
    model, tokenizer, _, _ = trace.load_any(tmp_path)
    ids = tokenizer.encode(PROMPT)
    t = len(ids) - 3
    with torch.no_grad():
        hf = reference(torch.tensor([ids]), output_hidden_states=True)
    expected = torch.softmax(hf.logits[0, t].double(), -1).numpy()
    blocks = trace.trace(model, ids, t)
    np.testing.assert_allclose(blocks[-1].lens, expected, rtol=1e-4, atol=1e-7)
    # transformers' hidden states after block 0 (before its final LayerNorm) are the stream trace measures
    np.testing.assert_allclose(blocks[1].norms[0], float(hf.hidden_states[1][0, t].norm()), rtol=1e-5)


def test_the_figure_is_drawn_and_replaced_only_when_drawn_here(run, tmp_path):
    require("matplotlib")
    out = tmp_path / "fig"
    assert call(["--checkpoint", str(run), "--prompt", PROMPT, "--out", str(out)])[0] == 0
    png = (out / trace.FIGURE).read_bytes()
    assert png.startswith(b"\x89PNG") and b"andrea.trace" in png[:4096]
    assert call(["--checkpoint", str(run), "--prompt", "import", "--out", str(out)])[0] == 0
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / trace.FIGURE).write_bytes(b"my own picture")
    code, _, err = call(["--checkpoint", str(run), "--prompt", PROMPT, "--out", str(tmp_path / "mine")])
    assert code == 2 and "not drawn by andrea.trace" in err
    assert (tmp_path / "mine" / trace.FIGURE).read_bytes() == b"my own picture"


def test_without_matplotlib_the_figure_is_refused_in_one_line(run, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    code, out, err = call(["--checkpoint", str(run), "--prompt", PROMPT, "--out", str(tmp_path / "f")])
    assert code == 2 and err == "error: andrea.trace --out needs matplotlib: pip install -e '.[plot]'\n"
    assert out == "" and not (tmp_path / "f").exists()


@pytest.mark.parametrize("flags, message", [
    (["--position", "99"], "--position 99 is outside the prompt's"),
    (["--position", "-99"], "--position -99 is outside the prompt's"),
    (["--prompt", ""], "--prompt is empty"),
    (["--top-k", "0"], "--top-k must be at least 1"),
    (["--device", "tpu"], "--device 'tpu' is not a device"),
])
def test_bad_flags_are_one_line_errors(run, flags, message):
    code, out, err = call(["--checkpoint", str(run), "--prompt", "import os"] + flags)
    assert code == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1 and out == ""
