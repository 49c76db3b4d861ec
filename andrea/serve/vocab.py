"""The tokenizer's routes, as vLLM's OpenAI-compatible server names them, so that a client can count
and cut prompts in the served model's own ids (lm-evaluation-harness's `tokenizer_backend=remote`):

    GET  /tokenizer_info   {"tokenizer_class", "eos_token", "bos_token", "pad_token", "model_max_length",
                            "vocab_size"}: the document separator <|endoftext|> is both eos and bos
    POST /tokenize         {"prompt": text, "add_special_tokens": bool, "model"?, "return_token_strs"?}
                           -> {"count", "max_model_len", "tokens"[, "token_strs"]}
    POST /detokenize       {"tokens": [ids], "model"?} -> {"prompt": text}

Text is encoded as a prompt is, except that the literal text "<|endoftext|>" becomes the separator's
id, as a Hugging Face GPT-2 tokenizer reads it (the harness finds the eos id by encoding the eos
token's text). `add_special_tokens` adds nothing: the model has no BOS token, and a prompt is sent as
it is (a client that wants a document's start sends the separator first).
"""

from __future__ import annotations

from andrea.serve import api

TOKENIZE = {"model", "prompt", "add_special_tokens", "return_token_strs"}
DETOKENIZE = {"model", "tokens"}


def eot_text(tokenizer) -> str:
    return tokenizer.token_bytes(tokenizer.eot_id).decode("utf-8")


def tokenizer_info(served: api.Served) -> dict:
    tok = served.tokenizer
    eot = eot_text(tok)
    return {"tokenizer_class": type(tok).__name__, "eos_token": eot, "bos_token": eot, "pad_token": None,
            "model_max_length": served.context, "vocab_size": tok.vocab_size}


def encode(tokenizer, text: str) -> list[int]:
    """The ids of `text`, each literal <|endoftext|> the separator's id."""
    eot = eot_text(tokenizer)
    ids = []
    for i, piece in enumerate(text.split(eot)):
        if i:
            ids.append(tokenizer.eot_id)
        ids += tokenizer.encode(piece) if piece else []
    return ids


def tokenize(body: dict, served: api.Served) -> dict:
    unknown = sorted(set(body) - TOKENIZE)
    if unknown:
        raise api.bad(unknown[0], "is not a field of a tokenize request (prompt, add_special_tokens, model, "
                      "return_token_strs)")
    api.check_model(body, served)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise api.bad("prompt", f"must be a string, got {api.shown(prompt)}")
    api.flag(body, "add_special_tokens")
    ids = encode(served.tokenizer, api.text("prompt", prompt))
    out = {"count": len(ids), "max_model_len": served.context, "tokens": ids}
    if api.flag(body, "return_token_strs"):
        out["token_strs"] = [served.tokenizer.token_bytes(i).decode("utf-8", errors="replace") for i in ids]
    return out


def detokenize(body: dict, served: api.Served) -> dict:
    unknown = sorted(set(body) - DETOKENIZE)
    if unknown:
        raise api.bad(unknown[0], "is not a field of a detokenize request (tokens, model)")
    api.check_model(body, served)
    tokens = body.get("tokens")
    if isinstance(tokens, list) and not tokens:
        return {"prompt": ""}
    ids = api.parse_ids(body, served, "tokens")
    return {"prompt": served.tokenizer.decode(ids)}
