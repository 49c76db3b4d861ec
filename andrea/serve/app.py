"""The HTTP side: a Starlette application over the model's engine.

    POST /v1/completions        OpenAI's completions (api.py says which fields), whole or streamed as
                                server-sent events ending with `data: [DONE]`
    POST /v1/chat/completions   refused: a base model has no chat template
    GET  /v1/models[/{id}]      the one model served
    GET  /health                200 while the model's thread runs, with its load; else 503
    POST /andrea/trace          {"ids": [...], "position": t, "top": k}: andrea.trace's figures for
                                position t (each block's residual, attention rows, logit lens)
    POST /andrea/tokens         {"ids": [...]} or {"text": "..."}: each token's text, for the page
    GET  /tokenizer_info        the tokenizer, and POST /tokenize, POST /detokenize: vLLM's routes,
                                which lm-evaluation-harness's remote tokenizer calls (vocab.py)
    GET  /                      the page (page/index.html, page.js, page.css: no other resource)

Every refusal has OpenAI's error shape. The work runs on the engine's thread; a handler waits for
its events, and a client that goes away cancels its job (a stream: Starlette cancels the response
when the connection closes; a whole answer: a watcher of the connection does).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from pathlib import Path

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from andrea.serve import api, vocab
from andrea.serve.api import ApiError
from andrea.serve.engine import Busy, Engine, Job, completion_steps, token_piece, trace_steps

PAGE = Path(__file__).parent / "page"
ASSETS = {"/": ("index.html", "text/html; charset=utf-8"), "/page.js": ("page.js", "text/javascript; charset=utf-8"),
          "/page.css": ("page.css", "text/css; charset=utf-8")}
# the page loads nothing but its own three files (the icon is an empty data: URL)
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # nginx: pass each event on at once


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


def as_api_error(error: Exception) -> ApiError:
    if isinstance(error, ApiError):
        return error
    if isinstance(error, Busy):
        kind, code = ("rate_limit_error", "queue_full") if error.status == 429 else ("server_error", "unavailable")
        out = ApiError(error.status, str(error), code=code, kind=kind)
        out.headers = {"Retry-After": "1"}
        return out
    return ApiError(500, f"the server failed on this request: {type(error).__name__}: {error}", kind="server_error")


async def read_json(request: Request) -> dict:
    """The body as a JSON object, refused past the server's size limit before it is all read."""
    limit = request.app.state.served.limits.max_request_bytes
    too_big = ApiError(400, f"the request body is over this server's limit of {limit} bytes "
                       "(andrea.serve --max-request-bytes)", code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_big
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_big
    try:
        data = json.loads(body, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise too_deep(body) from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    return data


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


SPACE = re.compile(r"[ \t\n\r]*")


def too_deep(body: bytes) -> ApiError:
    """The 400 for a body whose arrays or objects nest deeper than Python's JSON decoder goes (its
    recursion limit, ~1000 levels), naming the field they are in: the object's fields are decoded one
    by one until one fails the same way (only on this path: a request never nests past 2 levels)."""
    field = None
    try:
        doc, decoder = body.decode(json.detect_encoding(body), "surrogatepass"), json.JSONDecoder()
        at = SPACE.match(doc).end() + 1
        while doc[at - 1] in "{,":
            name, at = decoder.raw_decode(doc, SPACE.match(doc, at).end())
            at = SPACE.match(doc, at).end()
            if doc[at] != ":":
                break
            try:
                _, at = decoder.raw_decode(doc, SPACE.match(doc, at + 1).end())
            except RecursionError:
                field = name if isinstance(name, str) else None
                break
            at = SPACE.match(doc, at).end() + 1
    except (ValueError, IndexError):
        pass
    where = f"`{field}`" if field is not None else "the request body"
    return ApiError(400, f"{where} nests arrays or objects too deeply to decode (Python's JSON decoder stops at "
                    "~1000 levels): no field of a request nests more than 2 (a prompt as lists of token ids)",
                    param=field)


async def events(job: Job):
    """The job's events up to and including ("end", value); an ("error", e) raises e as an ApiError."""
    while True:
        kind, payload = await job.events.get()
        if kind == "error":
            if isinstance(payload, ClientGone):
                raise payload
            raise as_api_error(payload)
        yield kind, payload
        if kind == "end":
            return


def submit(request: Request, steps) -> Job:
    job = Job(asyncio.get_running_loop(), steps)
    try:
        request.app.state.engine.submit(job)
    except Busy as e:
        raise as_api_error(e) from None
    return job


async def result_of(request: Request, job: Job):
    """The job's return value, its events ignored; the job is cancelled if the client goes away."""
    async with watching(request, job):
        async for kind, payload in events(job):
            if kind == "end":
                return payload
    return None


@contextlib.asynccontextmanager
async def watching(request: Request, job: Job):
    """While inside: a client that disconnects cancels `job` and ends the wait on its events."""
    engine = request.app.state.engine

    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        engine.cancel(job)
        job.events.put_nowait(("error", ClientGone()))

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        engine.cancel(job)


# ----------------------------------------------------------------------------- completions


class Answer:
    """The completion object, built from a job's events: whole (merge) or as stream chunks (chunk)."""

    def __init__(self, request: api.Completion, name: str):
        self.request, self.name = request, name
        self.id, self.created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        self.choices = {}

    def head(self, choices, usage=None) -> dict:
        out = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.name,
               "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def chunk(self, kind: str, delta: dict) -> dict | None:
        """A stream chunk of one event; None for a delta with nothing in it."""
        choice = {"text": delta["text"], "index": delta["index"], "logprobs": delta.get("logprobs"),
                  "finish_reason": delta.get("finish_reason")}
        if self.request.return_token_ids and kind == "delta":
            choice["token_ids"] = delta["token_ids"]
            if "prompt_token_ids" in delta:
                choice["prompt_token_ids"] = delta["prompt_token_ids"]
        ids = choice.get("token_ids") or "prompt_token_ids" in choice
        if kind == "delta" and not (choice["text"] or choice["logprobs"] or ids):
            return None
        return self.head([choice])

    def merge(self, kind: str, delta: dict) -> None:
        logprobs = self.request.logprobs is not None
        choice = self.choices.setdefault(delta["index"], {
            "text": "", "index": delta["index"], "finish_reason": None,
            "logprobs": {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            if logprobs else None})
        choice["text"] += delta["text"]
        for key, values in (delta.get("logprobs") or {}).items():
            choice["logprobs"][key] += values
        if kind == "finish":
            choice["finish_reason"] = delta["finish_reason"]
        elif self.request.return_token_ids:
            choice.setdefault("prompt_token_ids", delta.get("prompt_token_ids"))
            choice["token_ids"] = choice.get("token_ids", []) + delta["token_ids"]

    def whole(self, usage) -> dict:
        return self.head([self.choices[i] for i in sorted(self.choices)], usage)


def sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def stream(request: Request, job: Job, answer: Answer):
    """The job's events as server-sent events: a chunk per token, the usage if asked, [DONE]."""
    try:
        async for kind, payload in events(job):
            if kind == "end":
                if answer.request.include_usage:
                    yield sse(answer.head([], payload))
                yield "data: [DONE]\n\n"
            elif (chunk := answer.chunk(kind, payload)) is not None:
                yield sse(chunk)
    except ApiError as e:  # the status line is sent already: the error is the last event
        yield sse(e.body())
    finally:
        request.app.state.engine.cancel(job)


async def completions(request: Request) -> Response:
    served = request.app.state.served
    body = await read_json(request)
    completion = await run_in_threadpool(api.parse_completion, body, served)  # encoding long prompts takes time
    job = submit(request, completion_steps(served, completion))
    answer = Answer(completion, served.name)
    if completion.stream:
        return StreamingResponse(stream(request, job, answer), media_type="text/event-stream", headers=SSE_HEADERS)
    async with watching(request, job):
        async for kind, payload in events(job):
            if kind == "end":
                return JSONResponse(answer.whole(payload))
            answer.merge(kind, payload)
    return Response(status_code=500)  # not reached: events() ends with "end" or raises


async def chat(request: Request) -> Response:
    raise ApiError(400, "chat completions need a chat template, and this model has none: it is a base model "
                   "trained on plain text. Send the text to continue to POST /v1/completions instead.",
                   param="messages", code="unsupported")


# ----------------------------------------------------------------------------- the rest


def model_card(request: Request) -> dict:
    served = request.app.state.served
    return {"id": served.name, "object": "model", "created": request.app.state.created, "owned_by": "andrea",
            "context_length": served.context}


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [model_card(request)]})


async def one_model(request: Request) -> Response:
    api.check_model({"model": request.path_params["model"]}, request.app.state.served)
    return JSONResponse(model_card(request))


async def health(request: Request) -> Response:
    engine = request.app.state.engine
    ok = engine.alive()
    return JSONResponse({"status": "ok" if ok else "unavailable", "model": request.app.state.served.name,
                         **engine.stats()}, status_code=200 if ok else 503)


async def trace(request: Request) -> Response:
    served = request.app.state.served
    body = await read_json(request)
    unknown = sorted(set(body) - {"ids", "position", "top"})
    if unknown:
        raise api.bad(unknown[0], "is not a field of a trace request (ids, position, top)")
    ids = api.parse_ids(body, served, most=served.limits.max_tokens + served.context)
    position = api.integer(body, "position", len(ids) - 1, 0, len(ids) - 1)
    top = api.integer(body, "top", 5, 1, 20)
    return JSONResponse(await result_of(request, submit(request, trace_steps(served, ids, position, top))))


async def tokens(request: Request) -> Response:
    served = request.app.state.served
    body = await read_json(request)
    if set(body) not in ({"ids"}, {"text"}):
        raise ApiError(400, "give exactly one of `ids` (a list of token ids) and `text` (a string)")
    if "text" in body:
        if not isinstance(body["text"], str):
            raise api.bad("text", "must be a string")
        ids = await run_in_threadpool(served.tokenizer.encode, api.text("text", body["text"]))
    else:
        ids = api.parse_ids(body, served, most=served.limits.max_tokens + served.context)
    return JSONResponse({"ids": ids, "pieces": [token_piece(served.tokenizer, i) for i in ids]})


async def tokenizer_info(request: Request) -> Response:
    return JSONResponse(vocab.tokenizer_info(request.app.state.served))


async def tokenize(request: Request) -> Response:
    body = await read_json(request)
    return JSONResponse(await run_in_threadpool(vocab.tokenize, body, request.app.state.served))


async def detokenize(request: Request) -> Response:
    body = await read_json(request)
    return JSONResponse(await run_in_threadpool(vocab.detokenize, body, request.app.state.served))


async def asset(request: Request) -> Response:
    name, media_type = ASSETS[request.url.path]
    return Response((PAGE / name).read_bytes(), media_type=media_type, headers=PAGE_HEADERS)


async def api_error(request: Request, error: Exception) -> Response:
    error = as_api_error(error)
    return JSONResponse(error.body(), status_code=error.status, headers=getattr(error, "headers", None))


async def gone(request: Request, error: ClientGone) -> Response:
    return Response(status_code=499)  # nginx's "client closed request": nobody reads it


async def http_error(request: Request, error: HTTPException) -> Response:
    status = error.status_code
    message = (f"{'no such route' if status == 404 else error.detail}: {request.method} {request.url.path} "
               "(the API: POST /v1/completions, GET /v1/models, GET /health, POST /tokenize)")
    body = ApiError(status, message, code="not_found" if status == 404 else None).body()
    return JSONResponse(body, status_code=status)


def create_app(served: api.Served, engine: Engine) -> Starlette:
    """The application; its lifespan starts the engine's thread and stops it."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            await run_in_threadpool(engine.stop)

    routes = [Route(path, asset) for path in ASSETS] + [
        Route("/health", health), Route("/v1/models", models), Route("/v1/models/{model:path}", one_model),
        Route("/v1/completions", completions, methods=["POST"]), Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/andrea/trace", trace, methods=["POST"]), Route("/andrea/tokens", tokens, methods=["POST"]),
        Route("/tokenizer_info", tokenizer_info), Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"])]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={ApiError: api_error, Busy: api_error, ClientGone: gone,
                                        HTTPException: http_error, Exception: api_error})
    app.state.served, app.state.engine, app.state.created = served, engine, int(time.time())
    return app
