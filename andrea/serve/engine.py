"""The model's one thread: requests queued, then stepped in turn, one token each, off the event loop.

    engine = Engine(slots=4, queue=16); engine.start()
    job = Job(loop, completion_steps(served, request)); engine.submit(job)   # Busy when full
    kind, payload = await job.events.get()                                   # on the event loop

A job is a generator of events that the thread advances one step at a time (a prefill, or one
token); each event goes to the job's asyncio queue, and the generator's return value ends it as
("end", value). Up to `slots` jobs are active, stepped round-robin so that every stream moves;
up to `queue` more wait. A full engine refuses at once (429) instead of queueing without bound;
a cancelled job (its client gone) is dropped before its next step.

One thread owns the model: its layers and backend keep workspaces that are not shared between
threads, and NumPy releases the GIL inside BLAS, so the event loop stays responsive while it
runs. Each sequence has its own key/value cache (andrea.sample.Decoder) and its own generator,
so a request's tokens are the same whether it runs alone or beside others.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque

import numpy as np

from andrea import trace as tracing
from andrea.sample import Decoder, sample_next
from minitensor.device import to_numpy

log = logging.getLogger("andrea.serve")


class Busy(Exception):
    """The engine cannot take a job: 429 when full, 503 when stopped."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Job:
    """A generator of events for the model thread, and the asyncio queue they reach."""

    def __init__(self, loop: asyncio.AbstractEventLoop, steps):
        self.loop, self.events, self.cancelled = loop, asyncio.Queue(), threading.Event()
        self._steps = steps

    def emit(self, event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancelled.set()

    def close(self) -> None:
        """Drop the work's state (a sequence's key/value cache) now, on the model's thread."""
        self._steps.close()

    def step(self) -> bool:
        """One step of the work; True when it is finished."""
        try:
            event = next(self._steps)
        except StopIteration as end:
            self.emit(("end", end.value))
            return True
        if event is not None:
            self.emit(event)
        return False


class Engine:
    def __init__(self, slots: int = 4, queue: int = 16):
        self.slots, self.queue = slots, queue
        self.steps = 0                      # steps taken, all jobs together
        self._lock = threading.Condition()
        self._pending, self._active = deque(), []
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="andrea-serve-model", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def submit(self, job: Job) -> None:
        with self._lock:
            if not self.alive():
                raise Busy(503, "the server is shutting down: retry on another instance")
            if len(self._pending) + len(self._active) >= self.slots + self.queue:
                raise Busy(429, f"the server is busy: {len(self._active)} requests running and {len(self._pending)} "
                           f"queued, its limit (andrea.serve --slots {self.slots} --queue {self.queue}); retry shortly")
            self._pending.append(job)
            self._lock.notify()

    def cancel(self, job: Job) -> None:
        """Stop `job` before its next step (a no-op for a finished one)."""
        job.cancelled.set()
        with self._lock:
            if job in self._pending:
                self._pending.remove(job)

    def stats(self) -> dict:
        with self._lock:
            return {"active": len(self._active), "queued": len(self._pending), "slots": self.slots,
                    "queue": self.queue, "steps": self.steps}

    def stop(self) -> None:
        """Finish the current step, refuse new work and end every job still held with an error."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()
        with self._lock:
            left = list(self._pending) + self._active
            self._pending.clear()
            self._active.clear()
        for job in left:
            job.emit(("error", Busy(503, "the server shut down before this request finished")))

    def _admit(self) -> list[Job] | None:
        """The jobs to step this round (waiting for one if there is none); None once stopping."""
        with self._lock:
            while not (self._stopping or self._pending or self._active):
                self._lock.wait()
            if self._stopping:
                return None
            while self._pending and len(self._active) < self.slots:
                self._active.append(self._pending.popleft())
            return list(self._active)

    def _run(self) -> None:
        while (jobs := self._admit()) is not None:
            for job in jobs:
                if job.cancelled.is_set() or self._step(job):
                    job.close()
                    with self._lock:
                        self._active.remove(job)

    def _step(self, job: Job) -> bool:
        try:
            done = job.step()
        except Exception as e:  # a bug, not the request's fault: report it and keep serving others
            log.exception("a request failed on the model's thread (a bug, not the request's fault)")
            job.emit(("error", e))
            done = True
        self.steps += 1
        return done


# ----------------------------------------------------------------------------- completions


def token_text(tokenizer, token_id: int) -> str:
    """A token as OpenAI's logprobs show it: its text, or "bytes:\\xNN..." when it is not whole UTF-8."""
    raw = tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def log_softmax(logits) -> np.ndarray:
    z = np.asarray(to_numpy(logits), dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def top_logprobs(tokenizer, logp, chosen: int, k: int) -> dict:
    """The k most likely tokens and the chosen one, text -> log probability (ties: the lower id first).
    O(V): only the ids at or above the k-th largest are sorted, not the whole vocabulary."""
    if k == 0:
        return {token_text(tokenizer, chosen): float(logp[chosen])}
    kth = np.partition(logp, -k)[-k] if k < len(logp) else logp.min()
    near = np.flatnonzero(logp >= kth)
    best = near[np.argsort(-logp[near], kind="stable")][:k].tolist()
    return {token_text(tokenizer, i): float(logp[i]) for i in [*best, chosen]}


class StopMatch:
    """How far the text so far goes into one stop string: `matched`, the length of the longest end of
    the text that begins the stop string (Knuth-Morris-Pratt), moved on a character at a time.

    Its table of borders (border(q): the longest proper prefix of stop[:q] that is also its suffix) is
    built only as far as a match has reached, so a stop string costs only what the text matches of it:
    over a whole completion the checks cost O(characters generated), amortised, whatever the stop
    strings' lengths (a request's stop strings are up to 1 MiB; generated text is max_tokens tokens).
    """

    def __init__(self, stop: str):
        self.stop, self.matched, self._borders = stop, 0, [0]

    def border(self, q: int) -> int:
        s, table = self.stop, self._borders
        while len(table) < q:          # table[i]: the border of stop[:i + 1]
            i, k = len(table), table[-1]
            while k and s[i] != s[k]:
                k = table[k - 1]
            table.append(k + (s[i] == s[k]))
        return table[q - 1]

    def feed(self, char: str) -> bool:
        """One more character of text; True when the text now ends with the whole stop string."""
        q, s = self.matched, self.stop
        while q and s[q] != char:
            q = self.border(q)
        self.matched = q = q + (s[q] == char)
        return q == len(s)


class StopText:
    """A completion's text, sent as soon as no stop string can still begin in it.

    Each new piece is read once per stop string (StopMatch): the text held back is the longest end of
    it that begins a stop string, and a stop string found ends the text at the earliest place one starts."""

    def __init__(self, stops):
        self.matches, self.text, self.sent = [StopMatch(s) for s in stops], "", 0

    def add(self, piece: str) -> tuple[str, bool]:
        """(the text now safe to send, whether a stop string ended the completion)."""
        start = len(self.text)
        self.text += piece
        found = []
        for m in self.matches:
            end = next((end for end, c in enumerate(piece, start + 1) if m.feed(c)), None)
            if end is not None:
                found.append(end - len(m.stop))
        if found:
            self.text = self.text[:min(found)]
            return self._send(len(self.text)), True
        held = max((m.matched for m in self.matches), default=0)
        return self._send(max(self.sent, len(self.text) - held)), False

    def finish(self, piece: str) -> tuple[str, bool]:
        """add() the last piece, then send whatever was held back: no more text can follow."""
        out, stopped = self.add(piece)
        return out + ("" if stopped else self._send(len(self.text))), stopped

    def _send(self, upto: int) -> str:
        out, self.sent = self.text[self.sent:upto], upto
        return out


def token_logprobs(tok, logits, chosen: int, k: int, offset: int) -> dict:
    """OpenAI's logprobs of one generated token, from its position's logits."""
    logp = log_softmax(logits)
    return {"tokens": [token_text(tok, chosen)], "token_logprobs": [float(logp[chosen])],
            "top_logprobs": [top_logprobs(tok, logp, chosen, k)], "text_offset": [offset]}


def prompt_logprobs(served, prompt, k: int) -> dict:
    """OpenAI's echo logprobs: each prompt token's log probability given the ones before it (the
    first has none), from one forward over the prompt."""
    tok = served.tokenizer
    ids = prompt.ids
    logits = served.model.forward_kv(np.array([ids]), served.model.new_kv_cache(1), 0, every=True)[0]
    logp = log_softmax(logits[:, :tok.vocab_size])
    decoder, offsets, text = tok.stream_decoder(), [], ""
    for i in ids:
        offsets.append(len(text))
        text += decoder.feed(i)
    return {"tokens": [token_text(tok, i) for i in ids],
            "token_logprobs": [None] + [float(logp[t - 1, ids[t]]) for t in range(1, len(ids))],
            "top_logprobs": [None] + [top_logprobs(tok, logp[t - 1], ids[t], k) for t in range(1, len(ids))],
            "text_offset": offsets}


def echo_delta(served, request, index: int, prompt) -> dict:
    delta = {"index": index, "text": prompt.text if request.echo else "", "token_ids": []}
    if request.echo and request.logprobs is not None:
        delta["logprobs"] = prompt_logprobs(served, prompt, request.logprobs)
    if request.return_token_ids:
        delta["prompt_token_ids"] = list(prompt.ids)
    return delta


def choice_steps(served, request, index: int, prompt, seed: int):
    """One choice's events: a first delta (the echo, the prompt's ids), a delta per token, a finish.
    Returns the tokens it generated. Sampling is andrea.sample.generate's, step for step, until the
    completion ends: max_tokens, a stop string, or <|endoftext|> (the document's end: not sent as
    text or id, but its log probability is, when logprobs are asked, as OpenAI's legacy API did)."""
    tok = served.tokenizer
    sequence = Decoder(served.model, prompt.ids)                    # the prefill
    yield ("delta", echo_delta(served, request, index, prompt))
    rng = np.random.default_rng(seed)
    text, decoder = StopText(request.stop), tok.stream_decoder()
    offset = len(prompt.text)          # OpenAI's text_offset counts from the prompt's start, echoed or not
    count, stopped, eot = 0, False, False
    while count < request.max_tokens and not stopped:
        logits = sequence.logits[:, :tok.vocab_size]
        nxt = int(sample_next(logits, rng, request.temperature, request.top_k, request.top_p)[0])
        count += 1
        delta = {"index": index, "token_ids": [] if nxt == tok.eot_id else [nxt]}
        if request.logprobs is not None:
            delta["logprobs"] = token_logprobs(tok, logits[0], nxt, request.logprobs, offset + len(text.text))
        if nxt == tok.eot_id:   # the end: its log probability is sent (a scoring client counts on one
            eot = True          # token after the echo), its text and id are not
            if request.logprobs is not None:
                yield ("delta", {**delta, "text": ""})
            break
        delta["text"], stopped = text.add(decoder.feed(nxt))
        yield ("delta", delta)
        if count < request.max_tokens and not stopped:
            sequence.push(nxt)
    tail, cut = ("", True) if stopped else text.finish(decoder.flush())   # cut: a stop string in the flush
    yield ("finish", {"index": index, "text": tail, "finish_reason": "stop" if cut or eot else "length"})
    return count


def completion_steps(served, request):
    """A whole request: its choices one after another; returns its usage."""
    completion_tokens = 0
    for index, prompt, seed in request.choices():
        completion_tokens += yield from choice_steps(served, request, index, prompt, seed)
    prompt_tokens = sum(len(p.ids) for p in request.prompts)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# ----------------------------------------------------------------------------- the page's trace


def token_piece(tokenizer, token_id: int) -> str:
    """A token's text for display: its bytes as UTF-8, a partial character as U+FFFD."""
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def ranked(tokenizer, probs, k: int) -> list:
    probs = probs[:tokenizer.vocab_size]
    return [[token_piece(tokenizer, i), int(i), float(probs[i])] for i in np.argsort(-probs, kind="stable")[:k]]


def trace_steps(served, ids, t: int, k: int):
    """andrea.trace's figures for position t of ids, as the page draws them: the last context_length
    tokens up to t, per block the residual's size, each head's attention row and the logit lens."""
    yield from ()                     # a generator without events: the thread's one step computes the result
    start = max(0, t + 1 - served.context)
    window = ids[start:t + 1]
    blocks = tracing.trace(served.model, window, len(window) - 1)
    output = tracing.model_output(served.model, window, len(window) - 1)
    tok = served.tokenizer
    return {"position": t, "start": start, "tokens": [token_piece(tok, i) for i in window], "blocks": [
        {"residual": [float(v) for v in b.norms], "attn_delta": b.attn_delta, "mlp_delta": b.mlp_delta,
         "ln_1": b.ln_1, "ln_2": b.ln_2,
         "attention": np.round(b.attention, 5).tolist(), "lens": ranked(tok, b.lens, k)} for b in blocks],
        "output": ranked(tok, output, k)}
