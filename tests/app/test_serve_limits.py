"""andrea.serve refuses what it cannot do, and never leaves work running: every bad request is a 400
in OpenAI's error shape naming the field and what to fix (the limits by name), before any model work;
a full queue is a 429 and a stopped engine a 503; a client that goes away, streaming or not, frees
its work at once. On a tiny model trained a few steps, each server in a thread of this process.
"""

import http.client
import json
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
