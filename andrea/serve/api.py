"""A completion request, checked field by field: OpenAI's legacy completions API for a base model.

    parse_completion(body, served) -> Completion      # or raises ApiError (400, 404)

OpenAI's fields, with its defaults: `prompt` (a string, a list of strings, a list of token ids or a
list of such lists; none or "" starts a new document: the model sees <|endoftext|> alone, as it does
at each document's start in training), `max_tokens` (16), `temperature` (1, in [0, 2]; 0: greedy;
any positive value samples, down to 5e-324), `top_p` (1), `n` (1), `stop` (up to 4 strings), `seed`,
`stream` (and `stream_options.include_usage`), `echo`, `logprobs` (0 to 5; `text_offset` counts from
the prompt's start, echoed or not), `user` (accepted, unused), `model` (this server's one model; may
be left out). Extensions: `top_k` (0 or none: no limit), as andrea.sample's --top-k, and
`return_token_ids` (the ids of the prompt and of the completion, as vLLM names them).

What a base model served this way cannot honour is refused with the reason: `suffix` (no
fill-in-the-middle training), `best_of` other than n (no server-side ranking), presence and
frequency penalties and `logit_bias` (sampling here is andrea.sample's, which has none of them).
An unknown field is refused by name, so a typo is not silently ignored. Limits: a prompt of at most
the context length, max_tokens and n x prompts at most the server's, each refusal naming its limit.
A string that UTF-8 cannot represent (a lone surrogate, such as JSON's "\ud800") is refused where
it would be read as text (a prompt, a stop string); a refusal quotes a value shortened (reprlib), so
that neither a huge nor a deeply nested one is copied into the error.

Seeds are andrea.sample's: choice j of a request with seed s draws from numpy's default_rng(s + j),
so choice 0 gives `python -m andrea.sample --seed s` with the same settings; without a seed each
request draws a fresh one.
"""

from __future__ import annotations

import math
import reprlib
import secrets
from dataclasses import dataclass
from typing import NamedTuple

SEED_LIMIT = 2 ** 63
MAX_STOPS = 4          # OpenAI's limits on stop strings and logprobs
MAX_LOGPROBS = 5
KNOWN = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "stream",
         "stream_options", "echo", "logprobs", "user", "return_token_ids",
         "suffix", "best_of", "presence_penalty", "frequency_penalty", "logit_bias"}


class ApiError(Exception):
    """A refusal in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        """The error object; a lone surrogate of the request quoted in it is written as its escape,
        so that the answer is always UTF-8."""
        message, param = (None if v is None else v.encode("utf-8", "backslashreplace").decode("utf-8")
                          for v in (self.message, self.param))
        return {"error": {"message": message, "type": self.kind, "param": param, "code": self.code}}


@dataclass(frozen=True)
class Limits:
    max_tokens: int = 1024            # the largest max_tokens a request may ask
    max_choices: int = 16             # n x prompts in one request
    max_request_bytes: int = 1 << 20  # a request's body


class Served(NamedTuple):
    model: object          # andrea.model.transformer.ANDREA
    tokenizer: object
    name: str              # the model's id in the API
    limits: Limits

    @property
    def context(self) -> int:
        return self.model.cfg.context_length


class Prompt(NamedTuple):
    ids: list[int]
    text: str              # what `echo` writes back


@dataclass(frozen=True)
class Completion:
    prompts: list[Prompt]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int | None
    n: int
    stop: tuple[str, ...]
    seed: int
    stream: bool
    include_usage: bool
    echo: bool
    logprobs: int | None
    return_token_ids: bool

    def choices(self):
        """(index, prompt, seed) of every choice: prompt i's j-th completion is index i * n + j."""
        return [(i * self.n + j, p, (self.seed + j) % SEED_LIMIT)
                for i, p in enumerate(self.prompts) for j in range(self.n)]


def bad(field: str, message: str) -> ApiError:
    return ApiError(400, f"`{field}` {message}", param=field)


QUOTE = reprlib.Repr()
QUOTE.maxlevel, QUOTE.maxstring, QUOTE.maxother = 3, 60, 60


def shown(value) -> str:
    """A request's value as a refusal quotes it: Python's repr, cut short past 60 characters or 3 levels."""
    return QUOTE.repr(value)


def text(field: str, value: str, where: str = "") -> str:
    """`value` if UTF-8 can represent it; a lone surrogate (half of a UTF-16 pair, alone) is refused."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(field, f"{where}holds a lone surrogate (U+{ord(value[e.start]):04X} at character {e.start}), "
                  "which is not Unicode text: send each surrogate as half of a pair (or the character itself)") \
            from None
    return value


# ----------------------------------------------------------------------------- one field each


def integer(body, field, default, low, high=None):
    value = body.get(field)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(field, f"must be a whole number, got {shown(value)}")
    if value < low or (high is not None and value > high):
        raise bad(field, f"must be in [{low}, {high}], got {value}" if high is not None
                  else f"must be at least {low}, got {value}")
    return value


def number(body, field, default, low, high, low_open=False):
    value = body.get(field)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad(field, f"must be a number, got {shown(value)}")
    if value > high or value < low or (low_open and value == low):
        raise bad(field, f"must be in {'(' if low_open else '['}{low}, {high}], got {value}")
    return float(value)


def flag(body, field):
    value = body.get(field)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(field, f"must be true or false, got {shown(value)}")
    return value


def stops(body) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(s, str) and s for s in values):
        raise bad("stop", f"must be a non-empty string or a list of them, got {shown(value)}")
    if len(values) > MAX_STOPS:
        raise bad("stop", f"holds {len(values)} strings, more than the {MAX_STOPS} allowed")
    return tuple(text("stop", s, f"[{i}] " if len(values) > 1 else "") for i, s in enumerate(values))


def include_usage(body, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise bad("stream_options", "is only allowed with stream: true")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise bad("stream_options", f"takes only include_usage, got {shown(options)}")
    return flag(options, "include_usage")


# ----------------------------------------------------------------------------- the prompt


def id_list(value, n_ids: int, what: str) -> list[int]:
    if not value or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise bad("prompt", f"{what} must be a non-empty list of token ids (whole numbers)")
    out_of_range = [i for i in value if not 0 <= i < n_ids]
    if out_of_range:
        raise bad("prompt", f"holds token id {out_of_range[0]}, outside the tokenizer's 0..{n_ids - 1}")
    return list(value)


def prompt_list(value, tok) -> list[Prompt]:
    """A list of strings, a list of ids or a list of lists of ids as prompts (ids' text decoded)."""
    if all(isinstance(v, str) for v in value):
        where = (lambda i: f"[{i}] ") if len(value) > 1 else (lambda i: "")
        texts = [text("prompt", v, where(i)) for i, v in enumerate(value)]
        return [Prompt(tok.encode(v) or [tok.eot_id], v) for v in texts]  # "": a new document
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        ids = [id_list(value, tok.vocab_size, "a list of ids")]
    elif all(isinstance(v, list) for v in value):
        ids = [id_list(v, tok.vocab_size, "each list of ids") for v in value]
    else:
        raise bad("prompt", "mixes strings, token ids and lists: give one kind")
    return [Prompt(i, tok.decode(i)) for i in ids]


def prompts(body, served: Served, n: int) -> list[Prompt]:
    """Each prompt as ids and text; a string, [strings], [ids] or [[ids]]; none is a new document.
    The count of completions (n x prompts) is checked before any prompt is encoded."""
    value = body.get("prompt")
    if value is None or isinstance(value, str):
        value = [value or ""]
    if not isinstance(value, list) or not value:
        raise bad("prompt", "must be a string, a list of strings, a list of token ids or a list of such lists")
    count = 1 if all(isinstance(v, int) for v in value) else len(value)
    if n * count > served.limits.max_choices:
        raise bad("n", f"x prompts is {n} x {count} = {n * count} completions, over this server's "
                  f"limit of {served.limits.max_choices} (andrea.serve --max-choices)")
    found = prompt_list(value, served.tokenizer)
    for p in found:
        if len(p.ids) > served.context:
            raise bad("prompt", f"is {len(p.ids)} tokens, over the model's context length of {served.context}: "
                      "shorten it")
    return found


# ----------------------------------------------------------------------------- the request


def refuse_unsupported(body, n: int) -> None:
    """The fields OpenAI defines that a base model served here cannot honour, unless left neutral."""
    reasons = {
        "suffix": (body.get("suffix") in (None, ""), "is not supported: the model was not trained to fill in "
                   "the middle"),
        "best_of": (body.get("best_of") in (None, n), "other than n is not supported: the server does not rank "
                    "completions"),
        "logit_bias": (body.get("logit_bias") in (None, {}), "is not supported by this server's sampling"),
    }
    for field in ("presence_penalty", "frequency_penalty"):
        reasons[field] = (body.get(field) in (None, 0), "is not supported: sampling here has no penalties")
    for field, (neutral, why) in reasons.items():
        if not neutral:
            raise bad(field, why)


def check_model(body, served: Served) -> None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", f"must be the model's id, a string (GET /v1/models), got {shown(model)}")
    if model is not None and model != served.name:
        raise ApiError(404, f"The model `{model}` does not exist: this server serves `{served.name}` "
                       "(GET /v1/models)", param="model", code="model_not_found")


def parse_completion(body: dict, served: Served) -> Completion:
    """The request's fields checked, its prompts encoded; ApiError names the first bad field."""
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise bad(unknown[0], "is not a field of a completion request (Unrecognized request argument)")
    check_model(body, served)
    limits = served.limits
    n = integer(body, "n", 1, 1)
    refuse_unsupported(body, n)
    max_tokens = integer(body, "max_tokens", 16, 0)
    if max_tokens > limits.max_tokens:
        raise bad("max_tokens", f"is {max_tokens}, over this server's limit of {limits.max_tokens} "
                  "(andrea.serve --max-tokens-limit)")
    found = prompts(body, served, n)
    stream = flag(body, "stream")
    top_k = integer(body, "top_k", 0, 0)
    seed = integer(body, "seed", None, 0, SEED_LIMIT - 1)
    return Completion(
        prompts=found, max_tokens=max_tokens, n=n, stream=stream, stop=stops(body),
        temperature=number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=top_k or None,
        seed=secrets.randbelow(SEED_LIMIT) if seed is None else seed,
        include_usage=include_usage(body, stream), echo=flag(body, "echo"),
        logprobs=integer(body, "logprobs", None, 0, MAX_LOGPROBS),
        return_token_ids=flag(body, "return_token_ids"),
    )


def parse_ids(body, served: Served, field: str = "ids", most: int | None = None) -> list[int]:
    """A non-empty list of the tokenizer's ids (the page's requests)."""
    value = body.get(field)
    n_ids = served.tokenizer.vocab_size
    if not isinstance(value, list) or not value or not all(isinstance(i, int) and not isinstance(i, bool)
                                                             and 0 <= i < n_ids for i in value):
        raise bad(field, f"must be a non-empty list of token ids in 0..{n_ids - 1}")
    if most is not None and len(value) > most:
        raise bad(field, f"holds {len(value)} ids, more than the {most} allowed")
    return value
