"""andrea.serve's API through OpenAI's own Python client, against a tiny model trained a few steps:
a completion is andrea.sample's for the same seed and settings (the key/value cache rebuilt past the
context included), streamed or whole; n, lists of prompts and token-id prompts index their choices
as OpenAI does; logprobs and echo are the model's own log-softmax, each token's text_offset counted
from the prompt's start, echoed or not (as OpenAI counts it); stop strings cut the text before
them, also across tokens, and <|endoftext|> ends a completion; requests made at once answer as each
made alone; the page's trace is andrea.trace's; docs/serving.md's curl commands and Python example
run as written. The bad inputs, the limits, the queue and disconnects: test_serve_limits.py.
"""
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from optional import require
from runs import tiny_run
from serving import call, serving

from andrea import sample
from andrea import trace as tracing
from andrea.cli import run_cli
from andrea.serve.engine import StopText, log_softmax

PROMPT = "def loads(s, *, cls=None):\n    return"
GUIDE = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_dir):
    return tiny_run(tmp_path_factory.mktemp("serve"), data_dir)


@pytest.fixture(scope="module")
def server(run):
    with serving(run) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    openai = require("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="not-checked", max_retries=0, timeout=60)


def sample_cli(run, prompt, n, temperature, top_k, top_p, seed):
    out = io.StringIO()
    argv = ["--checkpoint", str(run), "--prompt", prompt, "--max-new-tokens", str(n), "--temperature",
            str(temperature), "--top-k", str(top_k), "--top-p", str(top_p), "--seed", str(seed)]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit) as e:
        run_cli(sample.main, argv)
    assert e.value.code == 0
    return out.getvalue()


def test_the_decoders_logits_are_a_whole_forward_of_the_window_it_holds(run):
    """andrea.sample.Decoder, which the server and the sampler share (so that comparing them cannot tell):
    each push moves its window on by one token until the context is full, then rebuilds it from the
    last half of the context; its logits are always a whole forward's over that window."""
    model, tok, _ = sample.load_model(run)
    ctx, ids = model.cfg.context_length, tok.encode(PROMPT)
    decoder, pos = sample.Decoder(model, ids), len(ids)
    for step in range(ctx + 4):
        decoder.push(step % tok.vocab_size)
        pos = ctx // 2 if pos == ctx else pos + 1
        window = decoder.ids[-pos:]
        assert decoder.pos == pos and len(decoder.ids) == len(ids) + step + 1
        np.testing.assert_allclose(decoder.logits[0], model.forward(np.array([window]))[0, -1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("temperature, top_k, top_p, seed", [(0.8, 50, 1.0, 3), (1.0, 0, 0.9, 7), (0.0, 0, 1.0, 0)])
def test_a_completion_is_andrea_samples_for_the_same_seed(run, client, temperature, top_k, top_p, seed):
    # 40 tokens after a 12-token prompt pass the context of 32: the cache is rebuilt on the way
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=temperature, top_p=top_p,
                                    seed=seed, extra_body={"top_k": top_k})
    choice = got.choices[0]
    assert choice.finish_reason == "length" and got.usage.completion_tokens == 40
    assert PROMPT + choice.text + "\n" == sample_cli(run, PROMPT, 40, temperature, top_k, top_p, seed)
    streamed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=temperature,
                                         top_p=top_p, seed=seed, stream=True, extra_body={"top_k": top_k})
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.id == chunks[0].id and c.object == "text_completion" for c in chunks)


def test_n_prompt_lists_and_token_ids_index_choices_as_openai_does(server, client):
    tok = server.served.tokenizer
    got = client.completions.create(model="tiny", prompt=["def f", "import "], n=2, max_tokens=6, seed=11,
                                    extra_body={"return_token_ids": True})
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert got.usage.prompt_tokens == len(tok.encode("def f")) + len(tok.encode("import "))
    assert got.usage.completion_tokens == sum(len(c.token_ids) for c in got.choices)
    # choice j draws with seed + j; a prompt given as ids is the same prompt
    second = client.completions.create(model="tiny", prompt=tok.encode("import "), max_tokens=6, seed=12)
    assert second.choices[0].text == got.choices[3].text
    assert got.choices[2].prompt_token_ids == tok.encode("import ")
    assert tok.decode(got.choices[1].token_ids) == got.choices[1].text
    # an empty prompt starts a document: the model sees <|endoftext|> alone
    empty = client.completions.create(model="tiny", prompt="", max_tokens=3, seed=0, echo=True,
                                      extra_body={"return_token_ids": True})
    assert empty.choices[0].prompt_token_ids == [tok.eot_id] and empty.usage.prompt_tokens == 1


def test_logprobs_and_echo_are_the_models_log_softmax(server, client):
    tok, model = server.served.tokenizer, server.served.model
    got = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=8, seed=2, echo=True, logprobs=3,
                                    extra_body={"return_token_ids": True})
    choice = got.choices[0]
    ids = choice.prompt_token_ids + choice.token_ids
    assert choice.text.startswith("def f(x):") and len(choice.logprobs.tokens) == len(ids)
    logits = model.forward_kv(np.array([ids]), model.new_kv_cache(1), 0, every=True)[0]
    logp = log_softmax(logits[:, :tok.vocab_size])
    expected = [logp[t - 1, ids[t]] for t in range(1, len(ids))]
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    np.testing.assert_allclose(choice.logprobs.token_logprobs[1:], expected, rtol=1e-4, atol=1e-4)
    for t, top in enumerate(choice.logprobs.top_logprobs[1:], start=1):
        best = np.argsort(-logp[t - 1])[:3]
        assert len(top) <= 4 and min(top.values()) <= logp[t - 1, best[-1]] + 1e-4
        np.testing.assert_allclose(sorted(top.values())[-3:], np.sort(logp[t - 1, best]), rtol=1e-4, atol=1e-4)
    pieces = [tok.decode(ids[:t]) for t in range(len(ids))]
    assert choice.logprobs.text_offset == [len(p) for p in pieces]


def test_text_offset_counts_from_the_prompts_start_with_or_without_echo(server, client):
    tok, prompt = server.served.tokenizer, "def f(x):"
    for echo in (False, True):
        for stream in (False, True):
            got = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, seed=2, logprobs=0, echo=echo,
                                            stream=stream, extra_body={"return_token_ids": True})
            chunks = list(got) if stream else [got]
            offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
            ids = [i for c in chunks for i in (getattr(c.choices[0], "token_ids", None) or [])]
            prompt_ids = tok.encode(prompt)
            at = [len(tok.decode(prompt_ids[:t])) for t in range(len(prompt_ids))] if echo else []
            at += [len(prompt) + len(tok.decode(ids[:t])) for t in range(len(ids))]
            assert len(ids) == 8 and offsets == at, (echo, stream)


def test_stop_strings_end_the_text_before_them_even_across_tokens(client):
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, seed=5, logprobs=0)
    text = plain.choices[0].text
    offsets = [o - len(PROMPT) for o in plain.choices[0].logprobs.text_offset]  # from the completion's start
    edge = next(o for o in offsets[4:] if 0 < o < len(text) - 1 and text[o - 1:o + 1].strip())
    stop = text[edge - 1:edge + 1]                 # the last character of a token and the first of the next
    expected = text[:text.index(stop)]
    for stream in (False, True):
        got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, seed=5, stop=[stop, "\x00never"],
                                        stream=stream)
        chunks = list(got) if stream else [got]
        assert "".join(c.choices[0].text for c in chunks) == expected
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_text_holds_back_what_may_begin_a_stop_string():
    text = StopText(("END", "xyz"))
    assert text.add("abc E") == ("abc ", False)      # "E" may begin "END"
    assert text.add("N") == ("", False)
    assert text.add("Dless") == ("", True)           # "END": nothing after it is sent
    assert text.text == "abc "
    text = StopText(("END",))
    assert text.add("a E") == ("a ", False)
    assert text.finish("x") == ("Ex", False)         # the end: what was held back goes out
    assert StopText(()).add("anything") == ("anything", False)


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"] and client.models.retrieve("tiny").id == "tiny"
    openai = require("openai")
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="x")
    status, _, health = call(server.url, "/health")
    assert status == 200 and health["status"] == "ok" and health["model"] == "tiny"


def test_requests_made_at_once_answer_as_each_made_alone(server, client):
    asks = [dict(prompt=p, max_tokens=m, seed=s, stream=st, temperature=0.9)
            for p, m, s, st in [(PROMPT, 30, 1, False), ("import os", 25, 2, True), ("class A:", 20, 3, False),
                                ("def ", 35, 4, True), ("x = [", 15, 5, False), ("return", 28, 6, True)]]

    def ask(kwargs):
        got = client.completions.create(model="tiny", **kwargs)
        return "".join(c.choices[0].text for c in got) if kwargs["stream"] else got.choices[0].text

    alone = [ask(a) for a in asks]
    busiest, done = [0], threading.Event()

    def watch():
        while not done.wait(0.002):
            busiest[0] = max(busiest[0], server.engine.stats()["active"])

    watcher = threading.Thread(target=watch)
    watcher.start()
    with ThreadPoolExecutor(len(asks)) as pool:
        together = list(pool.map(ask, asks))
    done.set()
    watcher.join()
    assert together == alone
    assert busiest[0] >= 2  # they did run side by side


def test_the_pages_trace_is_andrea_traces(server):
    model, tok = server.served.model, server.served.tokenizer
    ids = tok.encode(PROMPT * 4)[:40]              # longer than the context of 32
    assert len(ids) == 40
    for position in (5, 38):
        status, _, got = call(server.url, "/andrea/trace", {"ids": ids, "position": position, "top": 3})
        assert status == 200, got
        start = max(0, position + 1 - model.cfg.context_length)
        window = ids[start:position + 1]
        blocks = tracing.trace(model, window, len(window) - 1)
        assert got["start"] == start and len(got["tokens"]) == len(window) and len(got["blocks"]) == len(blocks)
        for b, want in zip(got["blocks"], blocks):
            np.testing.assert_allclose(b["residual"], want.norms, rtol=1e-6)
            assert b["ln_1"] == pytest.approx(want.ln_1) and list(b["ln_2"]) == ["mean", "rstd"]  # the norm's stats
            np.testing.assert_allclose(b["attention"], want.attention, atol=1e-5)
            assert [e[1] for e in b["lens"]] == list(np.argsort(-want.lens, kind="stable")[:3])
        output = tracing.model_output(model, window, len(window) - 1)
        assert got["output"][0][1] == int(output.argmax())
    status, _, pieces = call(server.url, "/andrea/tokens", {"text": "def f"})
    assert status == 200 and pieces["ids"] == tok.encode("def f") and "".join(pieces["pieces"]) == "def f"


def test_the_guides_curl_commands_and_python_example_run_as_written(server):
    if not shutil.which("curl"):
        (pytest.fail if os.environ.get("CI") else pytest.skip)("no curl: apt-get install curl (.ci/run does)")
    text, here = GUIDE.read_text(), server.url.removeprefix("http://")
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)
    lines = [line for block in blocks for line in block.splitlines()]
    curls = [shlex.split(line, comments=True) for line in lines if line.startswith("curl ")]
    assert len(curls) == 4
    for words in curls:
        out = subprocess.run([w.replace("127.0.0.1:8000", here) for w in words], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0 and "error" not in out.stdout, (words, out.stdout, out.stderr)
        if "stream" in " ".join(words):
            assert out.stdout.rstrip().endswith("data: [DONE]") and out.stdout.count("data: {") >= 8
        else:
            assert isinstance(json.loads(out.stdout), dict)
    example = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)[0].replace("127.0.0.1:8000", here)
    out = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "completion_tokens=40" in out.stdout, out.stderr


def test_the_end_of_a_document_ends_the_completion(server, client):
    model, tok = server.served.model, server.served.tokenizer
    prompt = tok.encode("def")
    for seed in range(40):  # a seed whose draws reach <|endoftext|> within 300 tokens, found with andrea.sample
        drawn = list(sample.generate(model, prompt, 300, temperature=1.0, seed=seed, n_ids=tok.vocab_size))
        if tok.eot_id in drawn:
            break
    else:
        pytest.fail("no seed of 40 drew <|endoftext|> within 300 tokens")
    end = drawn.index(tok.eot_id)
    done = client.completions.create(model="tiny", prompt=prompt, max_tokens=300, seed=seed,
                                     extra_body={"return_token_ids": True})
    got = done.choices[0]
    assert got.finish_reason == "stop" and got.token_ids == drawn[:end]   # the end token itself is not sent
    assert got.text == tok.decode(drawn[:end]) and done.usage.completion_tokens == end + 1  # but counted
