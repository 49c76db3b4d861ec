"""`python -m andrea.eval RUN --task hellaswag|core --data ...`: multiple-choice benchmarks read from
files written here in their published formats (HellaSwag's JSON Lines; DCLM's CORE bundle as nanochat
reads it). A choice's log-likelihood is andrea.eval's own loss of the text with and without it; a
model trained 16 steps scores above chance on an easy fixture; endings it cannot tell apart score
exactly chance (ties count 1/j); bad files are one line naming what to fix.
"""

import contextlib
import io
import json
import random
import re

import numpy as np
import pytest
from runs import STDLIB_JSON, tiny_run

from andrea import eval as evaluation
from andrea import sample, tasks
from andrea.cli import run_cli

METRIC = re.compile(r"^(acc|acc_norm|acc_token) +(\S+)  95% interval \[(\S+), (\S+)\]$", re.M)
CORE_LINE = re.compile(r"^(\S+) +acc (\S+) \[(\S+), (\S+)\]  centred (\S+)  \(random (\S+), (\d+) items", re.M)


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_dir):
    return tiny_run(tmp_path_factory.mktemp("tasks"), data_dir, steps=16)


@pytest.fixture(scope="module")
def loaded(run):
    return evaluation.load_any(run)


def call(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        run_cli(evaluation.main, argv)
    return e.value.code, out.getvalue(), err.getvalue()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def easy_rows(n=40, seed=0):
    """HellaSwag-shaped items from the training corpus: a line's first half, its true second half
    among three strings of rare letters as long (the model has seen code, never such letters)."""
    lines = [s.strip() for s in (STDLIB_JSON / "decoder.py").read_text().splitlines() if 30 < len(s.strip()) < 50]
    rng, rows = random.Random(seed), []
    for line in lines[:n]:
        cut = len(line) // 2
        endings = ["".join(rng.choice("qxzjvkwyfbgp ") for _ in range(len(line) - cut)) for _ in range(3)]
        gold = rng.randrange(4)
        endings.insert(gold, line[cut:])
        rows.append({"ind": len(rows), "activity_label": "code", "ctx_a": line[:cut], "ctx_b": "",
                     "ctx": line[:cut], "endings": endings, "label": gold, "split": "val"})
    return rows


def metrics(out):
    found = {m[1]: tuple(float(v) for v in m.groups()[1:]) for m in METRIC.finditer(out)}
    assert set(found) == {"acc", "acc_norm", "acc_token"}, out
    return found


def nats(loaded, ids):
    """andrea.eval's summed loss of ids[1:], one window."""
    return evaluation.evaluate(loaded.model, loaded.tokenizer, np.array(ids), len(ids), 1).nats


# ----------------------------------------------------------------------------- HellaSwag


def test_a_choices_log_likelihood_is_andrea_evals_loss_with_and_without_it(loaded, tmp_path):
    item = tasks.hellaswag_items(write_jsonl(tmp_path / "h.jsonl", easy_rows(3)), loaded.tokenizer)[1]
    scorer = tasks.Scorer(loaded.model, loaded.tokenizer)
    for choice in item.choices:
        got, _ = scorer.continuation(choice.context, choice.continuation)
        ids = list(choice.context) + list(choice.continuation)
        expected = -(nats(loaded, ids) - nats(loaded, list(choice.context)))
        assert got == pytest.approx(expected, rel=1e-4, abs=1e-4)


def test_an_items_choices_scored_together_are_each_scored_alone(loaded, tmp_path):
    """One forward over the choices, padded on the right: the padding changes no choice's figure."""
    item = tasks.hellaswag_items(write_jsonl(tmp_path / "h.jsonl", easy_rows(4)), loaded.tokenizer)[3]
    assert len({len(c.context) + len(c.continuation) for c in item.choices}) > 1   # rows of several lengths
    together = tasks.Scorer(loaded.model, loaded.tokenizer)
    together.item(item)
    for c in item.choices:
        alone = tasks.Scorer(loaded.model, loaded.tokenizer).continuation(c.context, c.continuation)
        assert together.continuation(c.context, c.continuation) == (pytest.approx(alone[0], rel=1e-6), alone[1])


def test_a_trained_model_scores_above_chance_on_an_easy_fixture(run, loaded, tmp_path):
    path = write_jsonl(tmp_path / "hellaswag_val.jsonl", easy_rows())
    code, out, err = call([str(run), "--task", "hellaswag", "--data", str(path)])
    assert code == 0, err
    found = metrics(out)
    # acc_token (mean log probability per token) does not favour the shorter tokenisation: above chance
    # by its whole interval only because the model learned which text is code
    assert found["acc_token"][1] > 0.25, out
    assert found["acc"][0] > 0.5 and found["acc_norm"][0] > 0.5, out
    assert "items      40, chance 0.2500" in out and "40 HellaSwag items" in err
    # the figures are the items' credits, recomputed here from the scorer's sums
    scorer = tasks.Scorer(loaded.model, loaded.tokenizer)
    credits = []
    for item in tasks.hellaswag_items(path, loaded.tokenizer):
        sums = [scorer.continuation(c.context, c.continuation)[0] for c in item.choices]
        credits.append(float(np.argmax(sums) == item.gold))
        assert len(set(sums)) == 4   # no ties here: argmax is the rule
    mean = np.mean(credits)
    half = 1.959963984540054 * np.std(credits, ddof=1) / np.sqrt(len(credits))
    assert found["acc"] == pytest.approx((mean, max(0, mean - half), min(1, mean + half)), abs=5e-5)


def test_endings_the_model_cannot_tell_apart_score_exactly_chance(run, tmp_path):
    rows = [{"ctx": r["ctx"], "endings": [r["endings"][0]] * 4, "label": i % 4} for i, r in enumerate(easy_rows(8))]
    code, out, err = call([str(run), "--task", "hellaswag", "--data", str(write_jsonl(tmp_path / "t.jsonl", rows))])
    assert code == 0, err
    for metric, figures in metrics(out).items():
        assert figures == (0.25, 0.25, 0.25), (metric, out)


@pytest.mark.parametrize("scores, gold, expected", [([1, 2, 2, 0], 1, 0.5), ([1, 2, 2, 0], 0, 0.0),
                                                    ([3, 3, 3, 3], 2, 0.25), ([0, 5, 1, 2], 1, 1.0)])
def test_ties_share_the_credit(scores, gold, expected):
    assert tasks.credit(scores, gold) == expected


def test_acc_norm_divides_by_the_endings_characters_and_acc_token_by_its_tokens(loaded, tmp_path):
    rows = [{"ctx": "def f(x):", "endings": ["return x", "    return x + 1", "pass", "yield"], "label": 1}]
    item = tasks.hellaswag_items(write_jsonl(tmp_path / "one.jsonl", rows), loaded.tokenizer)[0]
    tok = loaded.tokenizer
    assert [c.chars for c in item.choices] == [8, 16, 4, 5]
    assert [list(c.continuation) for c in item.choices] == [tok.encode(" " + e) for e in rows[0]["endings"]]
    scorer = tasks.Scorer(loaded.model, loaded.tokenizer)
    sums = [scorer.continuation(c.context, c.continuation)[0] for c in item.choices]
    got = scorer.item(item)
    assert got.acc_norm == float(np.argmax([s / c.chars for s, c in zip(sums, item.choices)]) == 1)
    assert got.acc_token == float(np.argmax([s / len(c.continuation) for s, c in zip(sums, item.choices)]) == 1)


def test_the_hugging_face_layout_ctx_a_ctx_b_and_a_string_label_is_read(loaded, tmp_path):
    rows = [{"ctx_a": "A man sits.", "ctx_b": "he", "endings": ["a", "b", "c", "d"], "label": "2"}]
    item = tasks.hellaswag_items(write_jsonl(tmp_path / "hf.jsonl", rows), loaded.tokenizer)[0]
    assert item.gold == 2 and list(item.choices[0].context) == loaded.tokenizer.encode("A man sits. he")


def test_progress_is_reported_on_long_runs(run, tmp_path, monkeypatch):
    monkeypatch.setattr(tasks, "PROGRESS_SECONDS", 0.0)
    path = write_jsonl(tmp_path / "h.jsonl", easy_rows(5))
    code, out, err = call([str(run), "--task", "hellaswag", "--data", str(path), "--max-items", "3"])
    assert code == 0 and "items      3," in out, err
    assert re.findall(r"hellaswag  (\d)/3 items  acc_norm so far \S+  \S+ items/s, \d+ s left", err) == ["1", "2", "3"]


@pytest.mark.parametrize("content, message", [
    (None, "no such file; give HellaSwag's JSON Lines"),
    ('{"ctx": "a", "endings": ["a", "b", "c", "d"], "label": 4}\n', "line 1: `label` 4 is out of range 0..3"),
    ('{"ctx": "a", "endings": ["a", "b", "c", "d"], "label": -1}\n', "`label` -1 is out of range 0..3"),
    ('{"ctx": "a", "endings": ["a", "b", "c", "d"], "label": ""}\n', "no `label` (HellaSwag's test split"),
    ('{"ctx": "a", "endings": ["a", "b"], "label": 0}\n', "`endings` must be a list of 4 strings"),
    ('{"endings": ["a", "b", "c", "d"], "label": 0}\n', "no `ctx` (nor `ctx_a`/`ctx_b`)"),
    ('\n{"ctx": "a", "endings": ["a", "b", "c", "d"], "label": 0}\nnot json\n', "line 3: not JSON"),
    ('["ctx"]\n', "line 1: a JSON list, not an object"),
    ("", "holds no items"),
])
def test_a_bad_file_is_one_line_naming_what_to_fix(run, tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    if content is not None:
        path.write_text(content)
    code, out, err = call([str(run), "--task", "hellaswag", "--data", str(path)])
    assert code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1 and out == "", err


def test_task_and_data_go_together(run):
    code, _, err = call([str(run), "--task", "hellaswag"])
    assert code == 2 and "--task and --data go together" in err


# ----------------------------------------------------------------------------- CORE


def core_bundle(root, loaded, shots=1):
    """A CORE bundle of three tasks, one of each type, in nanochat's layout."""
    tok, model = loaded.tokenizer, loaded.model
    (root / "eval_data" / "lm").mkdir(parents=True)
    rows = easy_rows(12)
    mc = [{"query": r["ctx"], "choices": r["endings"], "gold": r["label"]} for r in rows]
    schema = [{"context_options": [r["ctx"], "zzqx vvk", "qqj wpf"], "continuation": r["endings"][r["label"]],
               "gold": 0} for r in rows]
    # language modelling: the model's own greedy continuations, where their text encodes back to
    # the same tokens (BPE need not give a generated sequence's ids back)
    lm = []
    for r in easy_rows(60):
        context = tok.encode(r["ctx"].strip())
        ids = list(sample.generate(model, context, 1, temperature=0.0, n_ids=tok.vocab_size))
        if tok.eot_id not in ids and tok.encode(tok.decode(ids)) == ids and len(lm) < 12:
            lm.append({"context": r["ctx"].strip(), "continuation": tok.decode(ids)})
    write_jsonl(root / "eval_data" / "mc.jsonl", mc)
    write_jsonl(root / "eval_data" / "schema.jsonl", schema)
    write_jsonl(root / "eval_data" / "lm" / "greedy.jsonl", lm)
    (root / "core.yaml").write_text(
        "icl_tasks:\n"
        f"- {{label: code_mc, dataset_uri: mc.jsonl, num_fewshot: [{shots}], icl_task_type: multiple_choice}}\n"
        f"- {{label: code_schema, dataset_uri: schema.jsonl, num_fewshot: [0], icl_task_type: schema}}\n"
        "- {label: code_lm, dataset_uri: lm/greedy.jsonl, num_fewshot: [0], icl_task_type: language_modeling,"
        " continuation_delimiter: ''}\n")
    (root / "eval_meta_data.csv").write_text("Eval Task,Task Category,Random baseline\ncode_mc,x,25\n"
                                             "code_schema,x,33.333\ncode_lm,x,0\n")
    return root


def test_core_reports_each_tasks_accuracy_its_centred_accuracy_and_core(run, loaded, tmp_path):
    bundle = core_bundle(tmp_path / "eval_bundle", loaded)
    code, out, err = call([str(run), "--task", "core", "--data", str(bundle)])
    assert code == 0, err
    rows = {m[1]: [float(v) for v in m.groups()[1:6]] + [int(m[7])] for m in CORE_LINE.finditer(out)}
    assert list(rows) == ["code_mc", "code_schema", "code_lm"], out
    for acc, low, high, centred, baseline, n in rows.values():
        assert n == 12 and low <= acc <= high
        assert centred == pytest.approx((acc - baseline) / (1 - baseline), abs=2e-4)
    assert rows["code_lm"][0] == 1.0       # the model's own greedy continuations, every one exact
    assert rows["code_mc"][0] > 0.25       # acc_token, as nanochat compares CORE's choices
    core = float(re.search(r"^CORE (\S+)  \(the mean centred accuracy of 3 tasks\)$", out, re.M)[1])
    assert core == pytest.approx(np.mean([r[3] for r in rows.values()]), abs=2e-4)


def test_a_wrong_greedy_continuation_counts_zero(run, loaded, tmp_path):
    bundle = core_bundle(tmp_path / "b", loaded)
    path = bundle / "eval_data" / "lm" / "greedy.jsonl"
    rows = [json.loads(s) for s in path.read_text().splitlines()]
    write_jsonl(path, [{**r, "continuation": r["continuation"] + "\x07"} for r in rows])
    code, out, err = call([str(run), "--task", "core", "--data", str(bundle)])
    assert code == 0 and re.search(r"^code_lm +acc 0\.0000 ", out, re.M), out + err


def test_few_shot_examples_are_nanochats_draw_before_each_item(loaded, tmp_path):
    bundle = core_bundle(tmp_path / "b", loaded, shots=2)
    task = tasks.core_tasks(bundle, loaded.tokenizer)[0]
    records = [json.loads(s) for s in (bundle / "eval_data" / "mc.jsonl").read_text().splitlines()]
    random.Random(1337).shuffle(records)
    for i in (0, 5):
        shots = random.Random(1234 + i).sample([j for j in range(12) if j != i], 2)
        prefix = "".join(records[j]["query"] + " " + records[j]["choices"][records[j]["gold"]] + "\n\n" for j in shots)
        assert loaded.tokenizer.decode(list(task.items[i].choices[0].context)) == prefix + records[i]["query"]
        assert task.items[i].gold == records[i]["gold"]


def test_identical_choices_are_chance_and_centre_to_zero(run, loaded, tmp_path):
    bundle = core_bundle(tmp_path / "b", loaded, shots=0)
    rows = [{"query": "def f", "choices": ["(x)"] * 4, "gold": i % 4} for i in range(8)]
    write_jsonl(bundle / "eval_data" / "mc.jsonl", rows)
    code, out, err = call([str(run), "--task", "core", "--data", str(bundle)])
    assert code == 0 and re.search(r"^code_mc +acc 0\.2500 \[0\.2500, 0\.2500\]  centred \+0\.0000 ", out, re.M), out


@pytest.mark.parametrize("damage, message", [
    (lambda b: (b / "core.yaml").unlink(), "core.yaml: no such file"),
    (lambda b: (b / "eval_meta_data.csv").write_text("Eval Task,Random baseline\ncode_mc,25\n"),
     "has no `Random baseline` for the task 'code_schema'"),
    (lambda b: (b / "eval_data" / "mc.jsonl").unlink(), "mc.jsonl: no such file; give the task 'code_mc'"),
    (lambda b: (b / "core.yaml").write_text("icl_tasks:\n- {label: code_mc, dataset_uri: mc.jsonl, "
                                             "icl_task_type: ranking}\n"), "`icl_task_type` must be one of"),
    (lambda b: write_jsonl(b / "eval_data" / "mc.jsonl", [{"query": "q", "choices": ["a", "b"], "gold": 2}] * 3),
     "`gold` 2 is out of range 0..1"),
])
def test_a_bad_bundle_is_one_line_naming_what_to_fix(run, loaded, tmp_path, damage, message):
    bundle = core_bundle(tmp_path / "b", loaded)
    damage(bundle)
    code, out, err = call([str(run), "--task", "core", "--data", str(bundle)])
    assert code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1, err
