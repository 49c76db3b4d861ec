"""Multiple-choice benchmarks from the user's files, scored by the log-likelihood the model gives each
choice: HellaSwag's JSON Lines and DCLM's CORE bundle (`python -m andrea.eval RUN --task ...`).

    items = hellaswag_items(path, tokenizer)            # or core_tasks(directory, tokenizer)
    score = Scorer(model, tokenizer).item(items[0])     # Credits: acc, acc_norm, acc_token

An item is a context and k continuations, one of them right (`gold`). Each continuation is scored by
the sum of its tokens' log probabilities given the context and the tokens before it (one forward
over each context + continuation, an item's choices batched; float64 log-softmax), and an item's three credits pick the best choice by
    acc        the sum (lm-evaluation-harness's acc)
    acc_norm   the sum / the ending's length in characters (the harness's acc_norm, api/task.py; for
               ASCII text, such as nearly all of HellaSwag, the same as per byte, its acc_bytes)
    acc_token  the sum / the continuation's tokens, the mean log probability per token (llm.c's
               hellaswag.py and nanochat's CORE, whose choices are compared this way)
Ties: when j choices share the best score and the right one is among them, the item counts 1/j (the
expected credit of a fair coin among them; the harness's argmax would give the first), so a model
that cannot tell the endings apart scores exactly chance. Identical (context, continuation) pairs are
scored once, so identical endings tie exactly.

HellaSwag (Zellers et al. 2019, rowanz/hellaswag data/hellaswag_{train,val}.jsonl): one JSON object
a line with `ctx` (or `ctx_a` and `ctx_b`), four `endings` and `label` (0..3, a number or a digit
string as the Hugging Face copy has it). Rendered as llm.c renders it: the context `ctx`, each
continuation " " + ending, encoded apart; the harness's own hellaswag task also prepends the activity
label and removes WikiHow's [bracketed] headers (run that one through andrea.serve and lm-eval).

CORE (Li et al. 2024, DCLM; nanochat's base_eval): a directory holding core.yaml (`icl_tasks`: each
with `label`, `dataset_uri`, `num_fewshot`, `icl_task_type`, `continuation_delimiter`), eval_data/
(each task's JSON Lines) and eval_meta_data.csv (`Eval Task`, `Random baseline` in percent). The
task types: multiple_choice ({query, choices, gold}), schema ({context_options, continuation, gold}:
the contexts differ) and language_modeling ({context, continuation}: right when greedy decoding
reproduces the whole continuation). As nanochat does, the items are shuffled with random.Random(1337),
item i's few-shot examples are random.Random(1234 + i).sample of the others, each written
"example<delimiter>answer\\n\\n" before it, choices are compared by acc_token, and a task's centred
accuracy is (acc - random) / (1 - random); CORE is their mean over the tasks.
"""

from __future__ import annotations

import csv
import json
import math
import random
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import yaml

from andrea.errors import UserError
from minitensor.device import to_numpy

Z95 = 1.959963984540054    # the normal distribution's 97.5th percentile
METRICS = ("acc", "acc_norm", "acc_token")


class Choice(NamedTuple):
    context: tuple[int, ...]
    continuation: tuple[int, ...]
    chars: int                 # the ending's length in characters (acc_norm's divisor)


class Item(NamedTuple):
    choices: list[Choice]
    gold: int
    greedy: bool = False       # language modelling: right when greedy decoding gives the continuation


class Credits(NamedTuple):
    acc: float
    acc_norm: float
    acc_token: float


def credit(scores, gold: int) -> float:
    """1/j if the right choice is one of the j best (ties shared), else 0."""
    best = max(scores)
    tied = [i for i, s in enumerate(scores) if s == best]
    return 1.0 / len(tied) if gold in tied else 0.0


def interval(values) -> tuple[float, float, float]:
    """(mean, low, high): a 95% normal interval from the items' credits' standard error (the
    harness's stderr x 1.96), clipped to [0, 1]; nan bounds for a single item."""
    v = np.asarray(values, dtype=np.float64)
    mean = float(v.mean())
    if len(v) < 2:
        return mean, math.nan, math.nan
    half = Z95 * float(v.std(ddof=1)) / math.sqrt(len(v))
    return mean, max(0.0, mean - half), min(1.0, mean + half)


# ----------------------------------------------------------------------------- scoring


def log_softmax(logits) -> np.ndarray:
    z = np.asarray(to_numpy(logits), dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


class Scorer:
    """Each continuation's log-likelihood given its context; an item's choices in one forward, its
    rows padded on the right (a causal model's earlier positions never see the padding)."""

    def __init__(self, model, tokenizer):
        self.model, self.n_ids = model, tokenizer.vocab_size
        self.eot = tokenizer.eot_id
        self._seen = {}

    def continuation(self, context, continuation) -> tuple[float, bool]:
        """(sum of the continuation's log probabilities, whether each token is the argmax). The
        context is cut on the left to fit the model's context length."""
        self._score([(tuple(context), tuple(continuation))])
        return self._seen[(tuple(context), tuple(continuation))]

    def _score(self, pairs) -> None:
        todo = list(dict.fromkeys(p for p in pairs if p not in self._seen))
        if not todo:
            return
        room = self.model.cfg.context_length + 1
        rows = []
        for context, continuation in todo:
            if len(continuation) >= room:
                raise UserError(f"a continuation of {len(continuation)} tokens does not fit the model's context "
                                f"length {self.model.cfg.context_length} with a token of context before it")
            rows.append((list(context) or [self.eot]) + list(continuation))
            rows[-1] = rows[-1][-room:]
        T = max(len(r) for r in rows) - 1
        x = np.array([r[:-1] + [self.eot] * (T + 1 - len(r)) for r in rows])
        logits = to_numpy(self.model.logits(x))
        for (context, continuation), row, z in zip(todo, rows, logits):
            n, end = len(continuation), len(row) - 1
            logp = log_softmax(z[end - n:end, :self.n_ids])
            picked = logp[np.arange(n), list(continuation)]
            greedy = bool((logp.argmax(axis=-1) == np.array(continuation)).all())
            self._seen[(context, continuation)] = (float(picked.sum()), greedy)

    def item(self, item: Item) -> Credits:
        self._score([(c.context, c.continuation) for c in item.choices])
        scored = [self._seen[(c.context, c.continuation)] for c in item.choices]
        if item.greedy:
            right = float(scored[0][1])
            return Credits(right, right, right)
        sums = [s for s, _ in scored]
        return Credits(credit(sums, item.gold),
                       credit([s / max(1, c.chars) for s, c in zip(sums, item.choices)], item.gold),
                       credit([s / len(c.continuation) for s, c in zip(sums, item.choices)], item.gold))


# ----------------------------------------------------------------------------- reading files


def read_jsonl(path, what: str) -> list[tuple[int, dict]]:
    """(line number, object) of each non-blank line; a missing file or a line that is not a JSON
    object is one line naming it."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file; give {what}")
    out = []
    with open(path, encoding="utf-8") as f:
        try:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as e:
                    raise UserError(f"{path}, line {n}: not JSON ({e}); {what} holds one JSON object a line") \
                        from None
                if not isinstance(record, dict):
                    raise UserError(f"{path}, line {n}: a JSON {type(record).__name__}, not an object; {what} holds "
                                    "one JSON object a line")
                out.append((n, record))
        except UnicodeDecodeError as e:
            raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); give {what}") from None
    if not out:
        raise UserError(f"{path} holds no items; give {what}")
    return out


def field(record: dict, name: str, kind, where: str):
    value = record.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise UserError(f"{where}: `{name}` must be {kind_name(kind)}, got {json.dumps(value)[:60]}")
    return value


def kind_name(kind) -> str:
    return {str: "a string", list: "a list", int: "a whole number"}.get(kind, str(kind))


def label(value, k: int, where: str, name: str = "label") -> int:
    """A right answer's index in 0..k-1, from a number or a digit string."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if value == "" or value is None:
        raise UserError(f"{where}: no `{name}` (HellaSwag's test split is unlabelled: give the val or train file)")
    if not isinstance(value, int) or isinstance(value, bool):
        raise UserError(f"{where}: `{name}` must be a whole number, got {json.dumps(value)[:60]}")
    if not 0 <= value < k:
        raise UserError(f"{where}: `{name}` {value} is out of range 0..{k - 1} for its {k} choices")
    return value


def strings(record: dict, name: str, where: str, count: int | None = None) -> list[str]:
    value = field(record, name, list, where)
    if not value or not all(isinstance(s, str) for s in value) or (count is not None and len(value) != count):
        raise UserError(f"{where}: `{name}` must be a list of {count or 'one or more'} strings, got "
                        f"{json.dumps(value)[:60]}")
    return value


def hellaswag_context(record: dict, where: str) -> str:
    if "ctx" in record:
        return field(record, "ctx", str, where)
    if "ctx_a" in record:
        a, b = field(record, "ctx_a", str, where), record.get("ctx_b") or ""
        return f"{a} {b}" if b else a
    raise UserError(f"{where}: no `ctx` (nor `ctx_a`/`ctx_b`): not HellaSwag's format (ctx, endings, label)")


def hellaswag_items(path, tokenizer, limit: int | None = None) -> list[Item]:
    """HellaSwag's JSON Lines as items: llm.c's rendering (ctx, then " " + each ending)."""
    what = "HellaSwag's JSON Lines (hellaswag_val.jsonl: ctx, endings, label)"
    items = []
    for n, record in read_jsonl(path, what)[:limit]:
        where = f"{path}, line {n}"
        context = tuple(tokenizer.encode(hellaswag_context(record, where)))
        endings = strings(record, "endings", where, count=4)
        gold = label(record.get("label"), len(endings), where)
        items.append(Item([Choice(context, tuple(tokenizer.encode(" " + e)), len(e)) for e in endings], gold))
    return items


# ----------------------------------------------------------------------------- DCLM's CORE


class Task(NamedTuple):
    label: str
    kind: str                  # multiple_choice, schema or language_modeling
    shots: int
    baseline: float            # chance accuracy, a fraction
    items: list[Item]


CORE_KINDS = ("multiple_choice", "schema", "language_modeling")
CORE_WHAT = "DCLM's CORE bundle (core.yaml, eval_data/, eval_meta_data.csv)"


def core_baselines(directory: Path) -> dict[str, float]:
    """Each task's random baseline, as a fraction, from eval_meta_data.csv."""
    path = directory / "eval_meta_data.csv"
    if not path.is_file():
        raise UserError(f"{path}: no such file; {CORE_WHAT} names each task's random baseline there")
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or not {"Eval Task", "Random baseline"} <= set(rows[0]):
        raise UserError(f"{path}: needs the columns `Eval Task` and `Random baseline` (in percent)")
    try:
        out = {r["Eval Task"]: float(r["Random baseline"]) / 100 for r in rows}
    except (ValueError, TypeError) as e:
        raise UserError(f"{path}: a `Random baseline` that is not a number ({e})") from None
    wrong = next((name for name, b in out.items() if not 0 <= b < 1), None)
    if wrong is not None:
        raise UserError(f"{path}: the task {wrong!r} has a `Random baseline` of {out[wrong] * 100:g}%, outside 0..100%")
    return out


def core_entries(directory: Path) -> list[dict]:
    path = directory / "core.yaml"
    if not path.is_file():
        raise UserError(f"{path}: no such file; --data names {CORE_WHAT}")
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not YAML ({str(e).splitlines()[0]})") from None
    tasks = config.get("icl_tasks") if isinstance(config, dict) else None
    if not isinstance(tasks, list) or not tasks or not all(isinstance(t, dict) for t in tasks):
        raise UserError(f"{path}: needs `icl_tasks`, a list of tasks (label, dataset_uri, num_fewshot, "
                        "icl_task_type)")
    return tasks


def core_tasks(directory, tokenizer, limit: int | None = None) -> list[Task]:
    """Every task of a CORE bundle, its items rendered with their few-shot examples."""
    directory = Path(directory)
    if not directory.is_dir():
        raise UserError(f"{directory}: no such directory; --data names {CORE_WHAT}")
    baselines, tasks = core_baselines(directory), []
    for i, entry in enumerate(core_entries(directory)):
        where = f"{directory / 'core.yaml'}, task {i + 1}"
        name, uri = field(entry, "label", str, where), field(entry, "dataset_uri", str, where)
        kind = entry.get("icl_task_type")
        if kind not in CORE_KINDS:
            raise UserError(f"{where}: `icl_task_type` must be one of {', '.join(CORE_KINDS)}, got {kind!r}")
        shots = entry.get("num_fewshot", [0])
        shots = shots[0] if isinstance(shots, list) and shots else shots
        if not isinstance(shots, int) or isinstance(shots, bool) or shots < 0:
            raise UserError(f"{where}: `num_fewshot` must be a whole number (or a list of them), got {shots!r}")
        if name not in baselines:
            raise UserError(f"{directory / 'eval_meta_data.csv'} has no `Random baseline` for the task {name!r}")
        records = read_jsonl(directory / "eval_data" / uri, f"the task {name!r}'s JSON Lines ({kind})")
        random.Random(1337).shuffle(records)
        render = Render(records[:limit], records, kind, shots, entry.get("continuation_delimiter", " "), tokenizer)
        tasks.append(Task(name, kind, shots, baselines[name], render.items(directory / "eval_data" / uri)))
    return tasks


class Render:
    """A CORE task's records as items: each with its few-shot examples before it, in nanochat's
    layout (the delimiter joins a context and its answer, a blank line follows each example). The
    examples are drawn from all the task's records, whatever `--max-items` keeps."""

    def __init__(self, records, pool, kind, shots, delimiter, tokenizer):
        self.records, self.pool, self.kind, self.shots = records, pool, kind, shots
        self.delimiter, self.tok = delimiter, tokenizer

    def items(self, path) -> list[Item]:
        if self.shots >= len(self.pool):
            raise UserError(f"{path}: {len(self.pool)} items cannot give {self.shots} few-shot examples each")
        return [self.item(i, n, record, f"{path}, line {n}") for i, (n, record) in enumerate(self.records)]

    def example(self, record: dict, where: str) -> str:
        """A solved example: its context, the delimiter, its right answer."""
        if self.kind == "multiple_choice":
            choices = strings(record, "choices", where)
            return field(record, "query", str, where) + self.delimiter + choices[label(
                record.get("gold"), len(choices), where, "gold")]
        if self.kind == "schema":
            options = strings(record, "context_options", where)
            return (options[label(record.get("gold"), len(options), where, "gold")] + self.delimiter
                    + field(record, "continuation", str, where))
        return field(record, "context", str, where).strip() + self.delimiter + field(record, "continuation", str, where)

    def item(self, i: int, n: int, record: dict, where: str) -> Item:
        others = [j for j in range(len(self.pool)) if j != i]
        shots = random.Random(1234 + i).sample(others, self.shots) if self.shots else []
        prefix = "".join(self.example(self.pool[j][1], f"{where} (an example)") + "\n\n" for j in shots)
        encode = self.tok.encode
        if self.kind == "multiple_choice":
            choices = strings(record, "choices", where)
            gold = label(record.get("gold"), len(choices), where, "gold")
            context = tuple(encode(prefix + field(record, "query", str, where)))
            return Item([Choice(context, tuple(encode(self.delimiter + c)), len(c)) for c in choices], gold)
        answer = field(record, "continuation", str, where)
        if self.kind == "schema":
            options = strings(record, "context_options", where)
            gold = label(record.get("gold"), len(options), where, "gold")
            return Item([Choice(tuple(encode(prefix + o)), tuple(encode(self.delimiter + answer)), len(answer))
                         for o in options], gold)
        context = tuple(encode(prefix + field(record, "context", str, where).strip()))
        return Item([Choice(context, tuple(encode(self.delimiter + answer)), len(answer))], 0, greedy=True)


# ----------------------------------------------------------------------------- running and reporting

PROGRESS_SECONDS = 10.0    # a progress line on stderr at most this often


def run(scorer: Scorer, items: list[Item], name: str, err) -> list[Credits]:
    """Every item's credits, with a line on `err` every PROGRESS_SECONDS: items done, acc_norm so
    far, the rate and the time left."""
    out, start = [], time.monotonic()
    last = start
    for item in items:
        out.append(scorer.item(item))
        now = time.monotonic()
        if now - last >= PROGRESS_SECONDS:
            last, rate = now, len(out) / (now - start)
            print(f"{name}  {len(out):,}/{len(items):,} items  acc_norm so far {np.mean([c.acc_norm for c in out]):.4f}"
                  f"  {rate:.1f} items/s, {(len(items) - len(out)) / rate:.0f} s left", file=err, flush=True)
    return out


def metric_line(metric: str, values) -> str:
    mean, low, high = interval(values)
    return f"{metric:<10} {mean:.4f}  95% interval [{low:.4f}, {high:.4f}]"


def report_hellaswag(scorer: Scorer, items: list[Item], out, err) -> None:
    credits = run(scorer, items, "hellaswag", err)
    for i, metric in enumerate(METRICS):
        print(metric_line(metric, [c[i] for c in credits]), file=out)
    print(f"items      {len(items):,}, chance 0.2500 (4 endings each; ties count 1/j among the j best)", file=out)


def report_core(scorer: Scorer, tasks: list[Task], out, err) -> None:
    """Each task's accuracy (acc_token; a language-modelling task's exact greedy match) with its
    interval and centred accuracy, then CORE, the centred accuracies' mean."""
    centred = []
    for task in tasks:
        credits = [c.acc_token for c in run(scorer, task.items, task.label, err)]
        mean, low, high = interval(credits)
        centred.append((mean - task.baseline) / (1 - task.baseline))
        print(f"{task.label:<32} acc {mean:.4f} [{low:.4f}, {high:.4f}]  centred {centred[-1]:+.4f}  "
              f"(random {task.baseline:.4f}, {len(credits):,} items, {task.shots}-shot {task.kind})", file=out)
    print(f"CORE {np.mean(centred):+.4f}  (the mean centred accuracy of {len(tasks)} task"
          f"{'s' if len(tasks) != 1 else ''})", file=out)
