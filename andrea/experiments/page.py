"""A Markdown page that holds the experiments' reports (docs/experiments.md), written by --doc:

    <!-- python -m andrea.experiment NAME: begin -->     each experiment's section: its report's body
    ...                                                  and figure (experiments/NAME.png beside the page)
    <!-- python -m andrea.experiment NAME: end -->
    <!-- python -m andrea.experiment, at a glance: begin -->   one row per verdict of every experiment:
    | the claim | command | verdict | ... | time |              the figures that decided it, the runs' time
    <!-- python -m andrea.experiment, at a glance: end -->

Everything outside the marker lines is the page's own prose, kept as it is. A section's tables hold
the per-run figures the verdicts read, so `--from-doc` can judge them again with the current rules
when the runs themselves are not at hand (rows_from_section): it rewrites the section's verdicts and
the at-a-glance rows, and leaves the tables and the figure as the runs wrote them. It judges again
the rules that compare arms by their final validation losses, which the tables print as the rules
read them (to 3 decimals); a rule reading a threshold in each run (base.kept_from_page: gradient
ratios, the logit lens, attention, printed rounded) keeps its verdict as the runs' report wrote it.
Where the page keeps the runs' figures beside it (experiments/NAME-runs.json, written with the section:
andrea.experiments.runfile), --from-doc judges those, at full precision, after checking that the
tables print them; a page without one is judged from its tables as printed.
A page a person edited is read as strictly as the report writes it: a figure deleted, a word where a
number goes, a row with a cell too few, a seed that is not a number, or one run given twice with
different figures is one line naming the row and what is wrong (the same row twice is read once).
"""

from __future__ import annotations

import math
import re
import shlex
import sys
from pathlib import Path

from andrea.errors import UserError
from andrea.experiments import runfile
from andrea.experiments.base import Verdict, fmt
from andrea.experiments.report import VERDICTS, verdict_block
from andrea.files import atomic_writer

GLANCE = "at a glance"
GLANCE_HEAD = ("| the claim | command | verdict | the paired difference, mean [95% t-interval] in nats, or the rule's "
               "reading | time |\n|---|---|---|---|---|\n")
# the words that mark a verdict --from-doc keeps as it found it (base.kept_from_page)
KEPT = " (kept as the runs' report wrote it: a reading of every seed's run, which the tables print rounded)"
VERDICT_LINE = re.compile(r"^\*\*(.+?): (supports|contradicts|leaves open)\*\*: (.*)\.$")


def markers(name):
    """The begin and end lines of experiment `name`'s section, or of the at-a-glance table (GLANCE)."""
    what = f"python -m andrea.experiment{', ' if name == GLANCE else ' '}{name}"
    return f"<!-- {what}: begin -->", f"<!-- {what}: end -->"


def read_page(doc) -> str:
    try:
        return Path(doc).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--doc {doc} cannot be read ({e}): give the Markdown file that holds the section") from None


def split(text, name, doc):
    """(the text up to and with the begin marker of `name`'s section, the section, the text from its
    end marker on); a one-line error naming the markers when the page has no such section."""
    begin, end = markers(name)
    head, sep, rest = text.partition(begin + "\n")
    middle, sep2, tail = rest.partition(end + "\n")
    if not (sep and sep2):
        raise UserError(f"--doc {doc} has no section for {name}: put the lines {begin} and {end} where it goes")
    return head + sep, middle, sep2 + tail


def doc_section(doc, name):
    """Checks that `doc` holds a section for `name` (a one-line error before any training if not)."""
    split(read_page(doc), name, doc)


def write_doc(doc, name, body, figure, glance, rows, command):
    """Write the report's body and figure into the doc's section for `name` (the figure beside the doc, in
    experiments/NAME.png, and the runs' figures in experiments/NAME-runs.json: andrea.experiments.runfile)
    and its rows into the at-a-glance table, where the page has one."""
    doc = Path(doc)
    head, _, tail = split(read_page(doc), name, doc)
    (doc.parent / "experiments").mkdir(exist_ok=True)
    with atomic_writer(doc.parent / "experiments" / f"{name}.png") as f:
        f.write(figure)
    runfile.write(doc, name, rows, command)
    text = with_glance(head + body + f"\n![{name}](experiments/{name}.png)\n" + tail, name, glance)
    with atomic_writer(doc) as f:
        f.write(text.encode())


def glance_rows(name, exp, verdicts, rows):
    """The at-a-glance rows of one experiment: per verdict, the claim, the command, the verdict, what
    decided it (Verdict.glance) and, on its first row, the runs' time added up."""
    seconds = [r["seconds"] for r in rows if r.get("seconds") is not None]
    total = sum(seconds)
    time = "not logged" if not seconds else f"{total:.0f} s" if total < 60 else f"{total / 60:.0f} min"
    lines = []
    for k, (what, v) in enumerate(verdicts):
        claim = exp.short if what == "claim" and exp.short else what
        lines.append(f"| {claim} | `{name}` | {v.verdict} | {v.glance} | {time if k == 0 else '(the same runs)'} |\n")
    return lines


def with_glance(text, name, lines):
    """`text` with `name`'s rows of the at-a-glance table replaced by `lines` (in the place of the first
    one, or at the table's end); unchanged when the page has no such table."""
    begin, end = markers(GLANCE)
    head, sep, rest = text.partition(begin + "\n")
    table, sep2, tail = rest.partition(end + "\n")
    if not (sep and sep2):
        return text
    rows = [x + "\n" for x in table.splitlines() if x.startswith("|") and not x.startswith(("| the claim", "|---"))]
    mine = [k for k, x in enumerate(rows) if x.split("|")[2].strip() == f"`{name}`"]
    at = mine[0] if mine else len(rows)
    rows = [x for k, x in enumerate(rows) if k not in mine]
    return head + sep + GLANCE_HEAD + "".join(rows[:at] + lines + rows[at:]) + sep2 + tail


# ----------------------------------------------------------------------------------------------- --from-doc

_NONE = ("never", "not logged", "not kept")  # what report.table and base.fmt print for a figure that is not there
RUN_COLUMNS = ("run", "final val loss", "unigram baseline - val loss", "|dL/dx| embeddings / top, step 1",
               "same, last step", "steps to train loss", "diverged", "time (s)")


def _number(cell, what="", may_be_none=True):
    """A table cell as report.table and base.fmt print it: a float, nan, or None ("never", "not
    logged" where `may_be_none`). `what` names the row and column for the one-line error on any other
    cell: an empty one (a figure deleted), words."""
    cell = cell.strip()
    if cell in _NONE and may_be_none:
        return None
    try:
        return float(cell.replace(",", ""))
    except ValueError:
        said = "is empty" if not cell else f"is {cell!r}, not a number"
        raise UserError(f"{what} {said}: put back the figure the runs' report wrote (--report-only --doc writes the "
                        "section again from the runs)") from None


def _table(lines, header):
    """The rows (lists of cells) of the Markdown table whose header line starts with `header`."""
    for k, line in enumerate(lines):
        if line.startswith(header):
            body = []
            for row in lines[k + 2:]:
                if not row.startswith("|"):
                    break
                body.append([c.strip() for c in re.split(r"(?<!\\)\|", row.strip())[1:-1]])  # not at "\|"
            return body
    return []


def _run_row(cells, exp, name):
    """One row of the table of runs, read; a one-line error naming the row and what is wrong with it."""
    where = f"the section for {name}: the row of run {cells[0] if cells else ''!r}"
    if len(cells) != len(RUN_COLUMNS):
        raise UserError(f"{where} has {len(cells)} cells, not the table's {len(RUN_COLUMNS)} "
                        f"({', '.join(RUN_COLUMNS)})")
    run, val, below, r0, r1, to, diverged, seconds = cells
    arm, _, seed = run.rpartition("-seed")
    if arm not in exp.arms:
        raise UserError(f"the section for {name} names a run {run!r} of no arm of {name}: is it its section?")
    if not seed.isdigit():
        raise UserError(f"{where}: its seed {seed!r} is not a number (a run is named ARM-seedN, e.g. {arm}-seed0)")
    if diverged not in ("yes", "no"):
        raise UserError(f"{where}: diverged is {diverged!r}, not yes or no")
    column = dict(zip(RUN_COLUMNS, cells))

    def figure(key, may_be_none=True):
        return _number(column[key], f"{where}: its {key!r}", may_be_none)

    val, below = figure("final val loss", False), figure("unigram baseline - val loss", False)
    return {"run": run, "arm": arm, "seed": int(seed), "val_loss": val, "ratio_init": figure(RUN_COLUMNS[3]),
            "ratio_final": figure(RUN_COLUMNS[4]), "steps_to_target": figure(RUN_COLUMNS[5]),
            "diverged": diverged == "yes", "seconds": figure("time (s)"), "exit_code": 0,
            "unigram_baseline": val + below if math.isfinite(val + below) else None}


def _run_rows(lines, exp, name):
    """A row per run of the section's first table, with the figures it prints. A run given twice is
    read once when its rows are the same (a line pasted twice), refused when their figures differ
    (which of them the runs wrote is not for --from-doc to guess)."""
    rows = {}
    for cells in _table(lines, "| run | final val loss |"):
        row = _run_row(cells, exp, name)
        earlier = rows.get(row["run"])
        if earlier is not None and not _same(earlier, row):
            raise UserError(f"the section for {name} has two rows for run {row['run']} (seed {row['seed']}) with "
                            "different figures: keep the one the runs' report wrote and delete the other")
        rows.setdefault(row["run"], row)
    return list(rows.values())


def _same(a, b):
    """Two rows of one run with the same figures (nan equal to nan)."""
    return all(a[k] == b[k] or (isinstance(a[k], float) and isinstance(b[k], float) and math.isnan(a[k])
                                and math.isnan(b[k])) for k in a)


def _cell_error(what):
    """A UserError for a table of the details that cannot be read (a cell cut, a word for a number)."""
    return UserError(f"{what} cannot be read (a cell missing or not a number): put back what the runs' report "
                     "wrote (--report-only --doc writes the section again from the runs)")


def _composition(lines, rows):
    """The logit lens and attention tables of the composition experiment's details, into their rows."""
    for r in rows:
        head = next((k for k, x in enumerate(lines) if x.startswith(f"{r['run']}: logit lens and attention")), None)
        if head is None:
            continue
        cells = _table(lines[head + 1:], "| depth |")
        try:
            blocks = [c for c in cells if c[0].startswith("block ")]
            uniform = next(c for c in cells if c[0] == "uniform attention")
            r.update(n_layer=len(blocks), lens_loss=[float(next(c for c in cells if c[0] == "embeddings")[1])] +
                     [float(c[1]) for c in blocks], lens_top=[c[2] for c in blocks],
                     distance=[[float(x) for x in c[3].split()] for c in blocks],
                     previous=[[float(x) for x in c[4].split()] for c in blocks],
                     uniform_distance=float(uniform[3]), uniform_previous=float(uniform[4]))
        except (ValueError, IndexError, StopIteration):
            raise _cell_error(f"{r['run']}'s table of the logit lens and attention") from None


def rows_from_section(middle, name, exp):
    """The rows the rules read, from a section's tables as report.report wrote them: the per-run table,
    the unigram baseline's line, the parameter counts (details_counts), the composition tables, and
    each run's depth from the experiment's definition and the command's --set. A figure the tables
    do not print (the sublayer changes at step 1) is absent, and the rule reading it keeps its line."""
    from andrea.config import load_config

    lines = middle.splitlines()
    rows = _run_rows(lines, exp, name)
    if not rows:
        raise UserError(f"the section for {name} has no table of runs: write it from the runs (--report-only --doc)")
    baseline = re.search(r"Unigram baseline of the validation tokens: ([0-9.]+) nats", middle)
    command = re.search(r"^Command: `(.*)`$", middle, re.M)
    words = shlex.split(command.group(1)) if command else []
    sets = [words[k + 1] for k, w in enumerate(words[:-1]) if w == "--set"]
    counts = {c[0]: c for c in _table(lines, "| run | parameters |")}
    for r in rows:
        if baseline:
            r["unigram_baseline"] = float(baseline.group(1))
        r["n_layer"] = load_config("tiny", exp.base + exp.arms[r["arm"]] + sets).model.n_layer
        if r["run"] in counts:
            try:
                _, params, first, stream = counts[r["run"]]
                r.update(params=int(params.replace(",", "")), first_nonfinite=None if first == "never" else int(first),
                         stream_rms_last=_number(stream))
            except (ValueError, UserError):
                raise _cell_error(f"the section for {name}: the row of run {r['run']!r} in the table of parameters"
                                  ) from None
    _composition(lines, rows)
    return rows


def _verdict_span(middle, name):
    """(where the section's verdicts begin, where its figure line begins)."""
    lines = middle.splitlines(keepends=True)
    starts = [k for k, x in enumerate(lines) if x.startswith(VERDICTS) or VERDICT_LINE.match(x.rstrip("\n"))]
    figure = next((k for k, x in enumerate(lines) if x.startswith(f"![{name}](")), len(lines))
    if not starts:
        raise UserError(f"the section for {name} has no verdicts: write it from the runs (--report-only --doc)")
    offset = [0]
    for x in lines:
        offset.append(offset[-1] + len(x))
    return offset[starts[0]], offset[figure]


def _again(rule, what, rows, old):
    """The rule's verdict on the page's rows; a rule marked kept_from_page keeps the page's line for it
    (`old`: what -> (verdict, why)), its words standing in the at-a-glance table too."""
    if not getattr(getattr(rule, "func", rule), "kept_from_page", False):
        return rule(rows)
    if what not in old:
        raise UserError(f"the page has no verdict on {what} to keep: write the section from the runs "
                        "(--report-only --doc)")
    verdict, why = old[what]
    plain = why.removesuffix(KEPT)
    return Verdict(verdict, plain + KEPT, plain)


def with_kept(doc, name, exp, rows):
    """(the rows the rules judge, where their figures come from, in words): the section's `rows` with
    the figures of the runs kept beside the page (andrea.experiments.runfile) where it keeps them, after
    checking that they are the tables' figures at full precision; else the tables' as printed."""
    runs = runfile.read(doc, name, exp.arms)
    if runs is None:
        return rows, "the per-run figures in the tables above (as printed)"
    path = runfile.path_of(doc, name)
    runfile.check_against(runs, rows, name, path, fmt)
    by_run = {r["run"]: r for r in runs}
    return ([{**r, **by_run[r["run"]]} for r in rows],
            f"the per-run figures kept in experiments/{path.name} (full precision; the tables above print them "
            "rounded)")


def page_runs(doc, name, exp):
    """The runs the page holds for `name` (for a --doc that adds seeds to them): the figures kept beside
    it (with_kept) where it keeps them, else its tables' as printed, each marked "from": "table", with
    the budget and the train-loss target its section prints; [] while the section holds no runs."""
    _, middle, _ = split(read_page(doc), name, doc)
    if not _table(middle.splitlines(), "| run | final val loss |"):
        return []
    rows, _ = with_kept(doc, name, exp, rows_from_section(middle, name, exp))
    if runfile.read(doc, name, exp.arms) is not None:
        return rows
    budget = re.search(r"^Budget: ([0-9,]+) steps, ([0-9,]+) training tokens per run", middle, re.M)
    target = re.search(r"steps to train loss ([0-9.]+) \|", middle)
    for r in rows:
        r.update({"from": "table", "target": float(target.group(1)) if target else None,
                  "steps": int(budget.group(1).replace(",", "")) if budget else None,
                  "tokens": int(budget.group(2).replace(",", "")) if budget else None})
    return rows


def runs_beside(doc, name, exp, rows):
    """The runs the page holds (page_runs) of the seeds `rows` (the runs of --out) lack: --doc adds
    seeds to a page whose earlier runs are gone, and the report covers them with the page's figures.
    Refused where such a run's budget (steps, training tokens) is not that of --out's runs of its arm;
    a run of --out replaces the page's run of the same seed."""
    have = {r["seed"] for r in rows}
    theirs = [r for r in page_runs(doc, name, exp) if r["seed"] not in have]
    budgets = {r["arm"]: (r.get("steps"), r.get("tokens")) for r in rows}
    for r in theirs:
        if budgets.get(r["arm"]) != (r.get("steps"), r.get("tokens")):
            raise UserError(f"--doc {doc}: its run {r['run']}, which --out does not hold, had another budget "
                            f"({r.get('steps')} steps, {r.get('tokens')} tokens) than --out's runs of {r['arm']}: "
                            f"train seed {r['seed']} again, or write the page into another file")
        r.setdefault("from", "page")
        for curve in ("losses", "vals", "grad_init", "grad_final"):
            r.setdefault(curve, [])
    if theirs:
        print(f"{name}: {', '.join(r['run'] for r in theirs)} not in --out: their figures are {doc}'s",
              file=sys.stderr, flush=True)
    return theirs


def rejudge(doc, name, exp, command):
    """--from-doc: the verdicts of `name`'s section judged again from its own tables with the current
    rules, written back into the section and the at-a-glance table; returns the new verdicts' text."""
    doc = Path(doc)
    head, middle, tail = split(read_page(doc), name, doc)
    rows, source = with_kept(doc, name, exp, rows_from_section(middle, name, exp))
    start, figure = _verdict_span(middle, name)
    found = map(VERDICT_LINE.match, middle[start:figure].splitlines())
    old = {m.group(1): (m.group(2), m.group(3)) for m in found if m}
    rules = [("claim", exp.judge)] + list(exp.more)
    verdicts = [(what, _again(rule, what, rows, old)) for what, rule in rules]
    block = verdict_block(verdicts, f"judged again from {source} by `{command}`")
    text = with_glance(head + middle[:start] + block + "\n" + middle[figure:] + tail, name,
                       glance_rows(name, exp, verdicts, rows))
    with atomic_writer(doc) as f:
        f.write(text.encode())
    return block
