"""andrea.serve refuses what it cannot do, and never leaves work running: every bad request is a 400
in OpenAI's error shape naming the field and what to fix (the limits by name), before any model work,
and leaves no traceback in the server's log (a lone surrogate, JSON nested past the decoder's depth);
any temperature the API accepts samples, down to the smallest double; a request with four stop
strings of 250 kB does not hold up another; a full queue is a 429 and a stopped engine a 503; a
client that goes away, streaming or not, frees its work at once. On a tiny model trained a few
steps, each server in a thread of this process.
"""

import http.client
import json
import threading
import time

import pytest
from optional import require
from runs import tiny_run
from serving import call, serving, wait_until

LIMITS = {"max_tokens": 200, "max_choices": 6, "max_request_bytes": 4096}
LONG = 100_000  # max_tokens that keeps the model busy for longer than any test waits: greedy, the tiny
GREEDY_LONG = {"prompt": "def", "max_tokens": LONG, "temperature": 0}  # model never reaches <|endoftext|>


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_dir):
    return tiny_run(tmp_path_factory.mktemp("serve-limits"), data_dir)


@pytest.fixture(scope="module")
def server(run):
    with serving(run, **LIMITS) as running:
        yield running


BAD = [  # (body, the field named, words the message holds)
    ({"max_tokens": -1}, "max_tokens", "at least 0"),
    ({"max_tokens": 1.5}, "max_tokens", "whole number"),
    ({"max_tokens": 201}, "max_tokens", "limit of 200 (andrea.serve --max-tokens-limit)"),
    ({"temperature": 3}, "temperature", "[0.0, 2.0]"),
    ({"temperature": "hot"}, "temperature", "must be a number"),
    ({"top_p": 0}, "top_p", "(0.0, 1.0]"),
    ({"top_k": -1}, "top_k", "at least 0"),
    ({"n": 0}, "n", "at least 1"),
    ({"n": 4, "prompt": ["a", "b"]}, "n", "4 x 2 = 8 completions, over this server's limit of 6"),
    ({"seed": -1}, "seed", "[0, 9223372036854775807]"),
    ({"seed": 2 ** 63}, "seed", "[0, 9223372036854775807]"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "more than the 4 allowed"),
    ({"stop": [""]}, "stop", "non-empty string"),
    ({"stop": 5}, "stop", "non-empty string"),
    ({"logprobs": 6}, "logprobs", "[0, 5]"),
    ({"stream": "yes"}, "stream", "true or false"),
    ({"echo": 1}, "echo", "true or false"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream: true"),
    ({"prompt": 5}, "prompt", "must be a string, a list of strings"),
    ({"prompt": []}, "prompt", "must be a string, a list of strings"),
    ({"prompt": ["a", 1]}, "prompt", "mixes strings"),
    ({"prompt": [99999]}, "prompt", "outside the tokenizer's"),
    ({"prompt": [[]]}, "prompt", "non-empty list of token ids"),
    ({"prompt": "x, " * 40}, "prompt", "over the model's context length of 32"),
    ({"suffix": "return x"}, "suffix", "fill in the middle"),
    ({"best_of": 3}, "best_of", "does not rank completions"),
    ({"presence_penalty": 0.5}, "presence_penalty", "no penalties"),
    ({"frequency_penalty": 1}, "frequency_penalty", "no penalties"),
    ({"logit_bias": {"1": 5}}, "logit_bias", "not supported"),
    ({"max_tokenz": 5}, "max_tokenz", "not a field of a completion request"),
    ({"prompt": "a\ud800b"}, "prompt", "holds a lone surrogate (U+D800 at character 1)"),
    ({"prompt": ["ok", "\udfff"]}, "prompt", "[1] holds a lone surrogate (U+DFFF at character 0)"),
    ({"stop": "\ud800"}, "stop", "holds a lone surrogate (U+D800"),
    ({"stop": ["x", "y\udc00"]}, "stop", "[1] holds a lone surrogate (U+DC00 at character 1)"),
    ({"\ud800": 1}, "\\ud800", "not a field of a completion request"),   # quoted as its escape
    ({"model": ["tiny"]}, "model", "must be the model's id, a string"),
    ({"temperature": "x" * 3000}, "temperature", "must be a number, got 'xxxxxxxxxxxxxxxxxxxxxxxxx"),
]
NESTED = b"[" * 1900 + b"]" * 1900       # deeper than Python's JSON decoder goes, within the 4096 bytes
RAW_BAD = [  # (body, the field named or None, words the message holds)
    (b'{"prompt": "x", "stop": ' + NESTED + b"}", "stop", "`stop` nests arrays or objects too deeply"),
    (b'{"prompt": "x", "\\u00e9": ' + NESTED + b"}", "\u00e9", "nests arrays or objects too deeply"),
    (NESTED, None, "the request body nests arrays or objects too deeply"),
    (b'{"stop": ' + b"[" * 900 + b"]" * 900 + b"}", "stop", "must be a non-empty string or a list of them"),
    (b'{"prompt": "\xed\xa0\x80"}', "prompt", "lone surrogate (U+D800"),   # the surrogate's bytes, not an escape
]


def is_openai_error(body, status=400):
    error = body["error"]
    return set(error) == {"message", "type", "param", "code"} and error["message"] and (
        status != 400 or error["type"] == "invalid_request_error")


def test_each_bad_field_is_an_openai_400_that_names_it_and_starts_no_work(server):
    before = server.engine.stats()
    for body, field, words in BAD:
        status, _, got = call(server.url, "/v1/completions", {"prompt": "def f", **body})
        assert status == 400 and is_openai_error(got), (body, got)
        assert got["error"]["param"] == field and words in got["error"]["message"], (body, got)
    assert server.engine.stats() == before  # refused before any model work
    # the neutral values of what is not supported are accepted
    neutral = {"suffix": None, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
               "user": "someone", "max_tokens": 2}
    status, _, got = call(server.url, "/v1/completions", {"prompt": "def f", **neutral})
    assert status == 200 and got["usage"]["completion_tokens"] == 2


def test_a_nested_or_not_unicode_body_is_a_400_that_names_its_field(server):
    for raw, field, words in RAW_BAD:
        status, _, got = call(server.url, "/v1/completions", raw=raw)
        assert status == 400 and is_openai_error(got), (raw[:40], got)
        assert got["error"]["param"] == field and words in got["error"]["message"], (raw[:40], got)
    status, _, got = call(server.url, "/andrea/tokens", {"text": "\udbff!"})
    assert status == 400 and got["error"]["param"] == "text" and "U+DBFF" in got["error"]["message"]


def test_any_temperature_the_api_accepts_samples_down_to_the_smallest_double(server):
    ask = {"prompt": "def f(x):", "max_tokens": 12, "seed": 3, "return_token_ids": True}
    status, _, greedy = call(server.url, "/v1/completions", {**ask, "temperature": 0})
    assert status == 200
    for temperature in (1e-30, 1e-300, 2.2250738585072014e-308, 5e-324):
        for extra in ({}, {"top_k": 5, "top_p": 0.5}, {"logprobs": 2}):
            status, _, got = call(server.url, "/v1/completions", {**ask, "temperature": temperature, **extra})
            assert status == 200, (temperature, extra, got)
            assert got["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"], (temperature, extra)


def test_no_bad_request_leaves_a_traceback_in_the_servers_log(server, monkeypatch):
    before = len(server.log)
    for body, _, _ in BAD:
        assert call(server.url, "/v1/completions", {"prompt": "def f", **body})[0] == 400
    for raw, _, _ in RAW_BAD:
        assert call(server.url, "/v1/completions", raw=raw)[0] == 400
    for path, raw in [("/andrea/tokens", NESTED), ("/andrea/trace", NESTED),
                      ("/andrea/tokens", b'{"text": "\\ud800"}'), ("/v1/completions", b"\xff\xfe")]:
        assert call(server.url, path, raw=raw)[0] == 400
    assert call(server.url, "/v1/completions", {"prompt": "def", "temperature": 5e-324, "max_tokens": 2})[0] == 200
    time.sleep(0.5)  # what uvicorn logs of a request comes after its answer
    logged = server.log[before:]
    assert not [line for line in logged if "Traceback" in line or line.startswith("ERROR")], logged
    # the log does hold what a bug leaves, in a handler or on the model's thread
    from andrea.serve import api, engine

    for module, name in [(api, "parse_completion"), (engine, "Decoder")]:
        with monkeypatch.context() as patch:
            patch.setattr(module, name, lambda *args: 1 / 0)
            status, _, got = call(server.url, "/v1/completions", {"prompt": "def", "max_tokens": 2})
        assert status == 500 and "ZeroDivisionError" in got["error"]["message"]
        wait_until(lambda: any("Traceback" in line and "ZeroDivisionError" in line for line in server.log[before:]),
                   what=f"the traceback of a bug in {name} logged")  # uvicorn logs it after the answer is sent
        before = len(server.log)


@pytest.mark.parametrize("raw, words", [(b"{not json", "not valid JSON"), (b"[1, 2]", "must be a JSON object"),
                                        (b'{"temperature": NaN}', "not valid JSON"), (b"\xff\xfe", "not valid JSON")])
def test_a_body_that_is_not_a_json_object_is_a_400(server, raw, words):
    status, _, got = call(server.url, "/v1/completions", raw=raw)
    assert status == 400 and is_openai_error(got) and words in got["error"]["message"]


def test_a_body_over_the_size_limit_is_refused_with_or_without_its_length(server):
    body = json.dumps({"prompt": "x" * 5000}).encode()
    status, _, got = call(server.url, "/v1/completions", raw=body)
    assert status == 400 and "limit of 4096 bytes (andrea.serve --max-request-bytes)" in got["error"]["message"]
    conn = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=10)
    conn.request("POST", "/v1/completions", body=iter([body[:3000], body[3000:]]), encode_chunked=True,
                 headers={"Transfer-Encoding": "chunked", "Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 400 and "4096 bytes" in json.loads(response.read())["error"]["message"]
    conn.close()


def test_what_is_not_the_completions_api_is_refused_in_openais_shape(server):
    openai = require("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="chat template"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    status, _, got = call(server.url, "/v1/embeddings", {"input": "x"})
    assert status == 404 and is_openai_error(got, 404) and "no such route" in got["error"]["message"]
    status, _, got = call(server.url, "/v1/completions")  # GET
    assert status == 405 and is_openai_error(got, 405)
    for path, body, words in [("/andrea/trace", {"ids": [1, 2], "position": 2}, "[0, 1]"),
                              ("/andrea/trace", {"ids": [], "position": 0}, "non-empty list"),
                              ("/andrea/trace", {"ids": [1], "colour": 1}, "not a field of a trace request"),
                              ("/andrea/tokens", {"ids": [1], "text": "a"}, "exactly one of")]:
        status, _, got = call(server.url, path, body)
        assert status == 400 and is_openai_error(got) and words in got["error"]["message"], (path, got)


def open_stream(url, body):
    """An HTTP connection with a streamed completion started on it, and its response."""
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({"stream": True, **body}),
                 headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def idle(engine):
    stats = engine.stats()
    return stats["active"] == stats["queued"] == 0


def test_a_full_queue_is_a_429_and_clients_that_leave_free_their_places(run):
    with serving(run, slots=1, queue=1, max_tokens=LONG) as server:
        running, first = open_stream(server.url, GREEDY_LONG)
        assert first.status == 200 and first.readline().startswith(b"data: ")
        waiting, second = open_stream(server.url, {"prompt": "x", "max_tokens": 5})
        wait_until(lambda: server.engine.stats()["queued"] == 1, what="the second request queued")
        status, headers, got = call(server.url, "/v1/completions", {"prompt": "y", "max_tokens": 5})
        assert status == 429 and is_openai_error(got, 429) and headers["Retry-After"] == "1"
        assert got["error"]["code"] == "queue_full" and "--slots 1 --queue 1" in got["error"]["message"]
        waiting.close()
        running.close()
        wait_until(lambda: idle(server.engine), what="both places freed")
        status, _, got = call(server.url, "/v1/completions", {"prompt": "y", "max_tokens": 5})
        assert status == 200 and got["usage"]["completion_tokens"] <= 5


def test_a_client_that_disconnects_frees_its_work_streaming_or_not(run):
    with serving(run, max_tokens=LONG) as server:
        conn, response = open_stream(server.url, GREEDY_LONG)
        for _ in range(3):
            assert response.readline()
        left = server.engine.stats()["steps"]
        conn.close()
        wait_until(lambda: idle(server.engine), what="the stream's job dropped")
        assert server.engine.stats()["steps"] - left < 1000  # dropped within well under a second
        conn = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps(GREEDY_LONG),
                     headers={"Content-Type": "application/json"})
        wait_until(lambda: server.engine.stats()["steps"] > left + 100, what="the whole answer's job running")
        left = server.engine.stats()["steps"]
        conn.close()
        wait_until(lambda: idle(server.engine), what="the whole answer's job dropped")
        steps = server.engine.stats()["steps"]
        assert steps - left < 1000
        time.sleep(0.3)
        assert server.engine.stats()["steps"] == steps  # nothing goes on in the background


def test_a_stopped_engine_is_a_503(run):
    with serving(run) as server:
        server.engine.stop()
        status, _, got = call(server.url, "/v1/completions", {"prompt": "def"})
        assert status == 503 and is_openai_error(got, 503) and "shutting down" in got["error"]["message"]
        status, _, got = call(server.url, "/health")
        assert status == 503 and got["status"] == "unavailable"


def test_four_stop_strings_of_250_kb_do_not_hold_up_another_request(run):
    """The stop check costs what each token adds, not the stop strings' length: a request that
    carries four of 250 kB (a body under the 1 MiB limit) and another of 2 tokens, from two clients
    at once on 127.0.0.1, and the small one answers about as fast as alone (it took 7 s instead of
    0.01 s when each token tested every prefix of every stop string on the model's thread)."""
    small = {"prompt": "x = ", "max_tokens": 2, "temperature": 0}
    big = {"prompt": "def", "max_tokens": 200, "temperature": 0, "stop": [c * 250_000 for c in "~|^`"]}
    assert len(json.dumps(big)) < 1 << 20
    with serving(run, max_tokens=200) as server:

        def timed(body):
            start = time.perf_counter()
            status, _, got = call(server.url, "/v1/completions", body, timeout=60)
            assert status == 200, got
            return time.perf_counter() - start, got

        alone = sorted(timed(small)[0] for _ in range(5))[2]
        for _ in range(3):   # at most 3 big requests, each with a small one sent while it runs
            big_answer, steps = [], server.engine.stats()["steps"]
            worker = threading.Thread(target=lambda: big_answer.append(timed(big)[1]))
            worker.start()
            wait_until(lambda: server.engine.stats()["steps"] > steps + 2 or not worker.is_alive(),
                       timeout=30, what="the big request running")
            during, _ = timed(small)
            worker.join(60)
            assert not worker.is_alive(), "the big request did not finish within 60 s"
            usage, choice = big_answer[0]["usage"], big_answer[0]["choices"][0]
            assert usage["completion_tokens"] == 200 and choice["finish_reason"] == "length"
            if during <= 10 * alone + 0.5:
                break
        assert during <= 10 * alone + 0.5, f"2 tokens took {during:.3f} s beside the big request, {alone:.3f} s alone"
