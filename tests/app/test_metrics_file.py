"""metrics.jsonl's one reader (andrea.run.metrics.read_records, by_step), on the lines a run can
leave: step records, a skipped step, a resume event, a line cut short by a crash, a step repeated by
a resume; and what it says of a file that is not a metrics file."""

import json

import pytest

from andrea.errors import UserError
from andrea.run.metrics import by_step, read_records

LINES = [
    json.dumps({"step": 1, "loss": 9.0}),
    json.dumps({"step": 2, "loss": "nan", "grad_norm": "nan", "skipped": True}),
    '{"step": 3, "lo',                                   # cut short by a full disk, ended by the next write
    json.dumps({"step": 3, "loss": 8.0}),
    "",
    json.dumps({"event": "resume", "at_step": 2, "checkpoint": "ckpt-00000002", "dropped_rows": 1}),
    json.dumps({"step": 3, "loss": 7.5}),              # the resumed run's step 3
]


def test_every_object_in_file_order_and_each_step_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(LINES) + "\n")
    records = read_records(path, strict=True)
    assert [r.get("step", r.get("event")) for r in records] == [1, 2, 3, "resume", 3]
    assert by_step(records) == {1: {"step": 1, "loss": 9.0}, 3: {"step": 3, "loss": 7.5}}
    assert read_records(tmp_path / "missing.jsonl") == []


def test_a_file_that_is_not_a_metrics_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(LINES[0] + "\nnot json\n[1, 2]\n")
    assert read_records(path) == [{"step": 1, "loss": 9.0}]  # resume and experiments pass over it
    with pytest.raises(UserError, match=r"line 2 is not JSON: is it a metrics file of andrea.train\?$"):
        read_records(path, strict=True)                       # plot and --grad-flow say it
