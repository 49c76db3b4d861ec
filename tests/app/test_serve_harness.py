"""lm-evaluation-harness against `andrea.serve`: the tokenizer's routes as vLLM names them
(/tokenizer_info, /tokenize, /detokenize), scoring requests (prompt ids, echo, logprobs, max_tokens 0
or 1) answered with each prompt token's log probability as andrea.eval computes it, the end of a
document's log probability kept in the logprobs, and the real harness (`lm_eval`, the `local-completions`
model, its remote tokenizer) run offline on a local JSON Lines task against a server on 127.0.0.1.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from optional import require
from runs import tiny_run
from serving import call, serving

from andrea import eval as evaluation
from andrea import tasks
from andrea.serve import api
from andrea.serve import engine as serve_engine


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_dir):
    return tiny_run(tmp_path_factory.mktemp("harness"), data_dir, steps=8)


@pytest.fixture(scope="module")
def server(run):
    with serving(run) as running:
        yield running


# ----------------------------------------------------------------------------- the tokenizer's routes


def test_tokenizer_info_names_the_separator_as_eos_and_the_context(server):
    status, _, info = call(server.url, "/tokenizer_info")
    tok = server.served.tokenizer
    assert status == 200 and info["eos_token"] == info["bos_token"] == "<|endoftext|>"
    assert info["model_max_length"] == server.served.context and info["vocab_size"] == tok.vocab_size


def test_tokenize_and_detokenize_are_the_models_tokenizer(server):
    tok = server.served.tokenizer
    text = "def f(x):<|endoftext|>return x"
    status, _, got = call(server.url, "/tokenize", {"prompt": text, "add_special_tokens": False,
                                                     "return_token_strs": True})
    ids = tok.encode("def f(x):") + [tok.eot_id] + tok.encode("return x")
    assert status == 200 and got["tokens"] == ids and got["count"] == len(ids)
    assert got["max_model_len"] == server.served.context and "".join(got["token_strs"]) == text
    status, _, back = call(server.url, "/detokenize", {"tokens": ids, "model": "tiny"})
    assert status == 200 and back == {"prompt": text}
    assert call(server.url, "/tokenize", {"prompt": "<|endoftext|>"})[2]["tokens"] == [tok.eot_id]


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": 3}, "prompt"), ("/tokenize", {"text": "a"}, "text"),
    ("/tokenize", {"prompt": "a", "model": "other"}, "model"), ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"), ("/tokenize", {"prompt": "a", "add_special_tokens": 1},
                                                    "add_special_tokens")])
def test_a_bad_tokenizer_request_is_refused_naming_its_field(server, path, body, param):
    status, _, got = call(server.url, path, body)
    assert status in (400, 404) and got["error"]["param"] == param, got


# ----------------------------------------------------------------------------- scoring


def scoring(server, ids, max_tokens=1):
    """The harness's loglikelihood request (LocalCompletionsAPI._create_payload, generate=False)."""
    status, _, got = call(server.url, "/v1/completions", {"model": "tiny", "prompt": ids, "temperature": 0,
                                                           "max_tokens": max_tokens, "logprobs": 1,
                                                           "seed": 1234, "echo": True})
    assert status == 200, got
    return got["choices"][0]["logprobs"]


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_a_texts_log_likelihood_is_andrea_evals(server, max_tokens):
    model, tok = server.served.model, server.served.tokenizer
    ids = tok.encode("def loads(s, *, cls=None):\n    return")
    logprobs = scoring(server, ids, max_tokens)
    assert len(logprobs["token_logprobs"]) == len(ids) + max_tokens
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    nats = evaluation.evaluate(model, tok, np.array(ids), len(ids), 1).nats
    assert -sum(logprobs["token_logprobs"][1:len(ids)]) == pytest.approx(nats, rel=1e-5)
    # and each continuation's, as andrea.eval --task scores it
    scorer = tasks.Scorer(model, tok)
    for cut in (1, 5, len(ids) - 1):
        total, greedy = scorer.continuation(tuple(ids[:cut]), tuple(ids[cut:]))
        assert sum(logprobs["token_logprobs"][cut:len(ids)]) == pytest.approx(total, rel=1e-5, abs=1e-6)
        top = logprobs["top_logprobs"][cut:len(ids)]
        assert greedy == all(lp == max(t.values()) for lp, t in zip(logprobs["token_logprobs"][cut:], top))


def test_a_completion_that_ends_the_document_keeps_its_log_probability(server, monkeypatch):
    """max_tokens 1 must give one log probability after the echo even when the token drawn is
    <|endoftext|> (the harness drops the last entry): it is sent, its text and id are not."""
    served, tok = server.served, server.served.tokenizer
    monkeypatch.setattr(serve_engine, "sample_next", lambda logits, *a: np.array([tok.eot_id]))
    body = {"prompt": tok.encode("import json"), "max_tokens": 1, "logprobs": 2, "echo": True,
            "return_token_ids": True}
    events = list(serve_engine.completion_steps(served, api.parse_completion(body, served)))
    deltas = [p for kind, p in events if kind == "delta"]
    end = deltas[-1]
    assert end["text"] == "" and end["token_ids"] == [] and end["logprobs"]["tokens"] == ["<|endoftext|>"]
    ids = body["prompt"]
    logits = served.model.forward_kv(np.array([ids]), served.model.new_kv_cache(1), 0)
    expected = serve_engine.log_softmax(logits[0, :tok.vocab_size])[tok.eot_id]
    assert end["logprobs"]["token_logprobs"] == [pytest.approx(expected, rel=1e-6)]
    assert events[-1] == ("finish", {"index": 0, "text": "", "finish_reason": "stop"})


# ----------------------------------------------------------------------------- the real harness


TASK = """\
task: andrea_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{ctx}}}}"
doc_to_choice: "{{{{endings}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def harness_items():
    lines = ["def loads(s, *, cls=None, object_hook=None):", "import re", "class JSONDecodeError(ValueError):",
             "return _default_decoder.decode(s)", "if isinstance(s, str):", "raise TypeError(msg)"]
    rows = []
    for i, line in enumerate(lines):
        head, _, tail = line.partition(" ")
        endings = [tail, "zzq vvk", "qqjx wp", "kkx yyz"]
        endings[0], endings[i % 4] = endings[i % 4], endings[0]
        rows.append({"ctx": head, "endings": endings, "label": i % 4})
    return rows


def test_lm_eval_local_completions_scores_a_local_task_through_the_server(run, server, tmp_path):
    require("lm_eval")
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in harness_items()))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "andrea_tiny_choice.yaml").write_text(TASK.format(data=data))
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
               f"base_url={server.url}/v1/completions,model=tiny,tokenizer_backend=remote,"
               "tokenized_requests=True,max_length=32,num_concurrent=1,max_retries=1",
               "--tasks", "andrea_tiny_choice", "--include_path", str(tmp_path / "tasks"),
               "--output_path", str(tmp_path / "out"), "--log_samples"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, textwrap.shorten(done.stderr[-3000:], 3000)
    found = list((tmp_path / "out").rglob("results_*.json"))
    samples = list((tmp_path / "out").rglob("samples_andrea_tiny_choice_*.jsonl"))
    assert len(found) == 1 and len(samples) == 1, done.stderr[-2000:]
    results = json.loads(found[0].read_text())["results"]["andrea_tiny_choice"]
    logged = sorted((json.loads(s) for s in samples[0].read_text().splitlines()), key=lambda s: s["doc_id"])
    # the same items scored by andrea.eval --task's scorer: the harness's log-likelihood of each
    # ending is the scorer's, and its acc and acc_norm are the argmax over the same sums
    tok = server.served.tokenizer
    scorer = tasks.Scorer(server.served.model, tok)
    acc, acc_norm = [], []
    for row, sample in zip(harness_items(), logged, strict=True):
        sums = [scorer.continuation(tuple(tok.encode(row["ctx"])), tuple(tok.encode(" " + e)))[0]
                for e in row["endings"]]
        np.testing.assert_allclose([float(ll) for ll, _ in sample["filtered_resps"]], sums, rtol=1e-5)  # logged as text
        acc.append(np.argmax(sums) == row["label"])
        acc_norm.append(np.argmax([s / len(e) for s, e in zip(sums, row["endings"])]) == row["label"])
    assert results["acc,none"] == pytest.approx(np.mean(acc)) and results["acc_norm,none"] == pytest.approx(
        np.mean(acc_norm)), (results, acc, acc_norm)
