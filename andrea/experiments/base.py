"""What every experiment shares: the Experiment record, the default model's shape (LEARNS), and the
words a verdict is made of: a Verdict, the paired claims (one arm ends lower than another; one ends
no worse, within a Margin), the runs that did not learn. The claims' modules (residual, norm, mlp,
composition) build their rules from these; andrea.experiments.paired holds the statistics."""

from __future__ import annotations

import io
import math
import statistics
from dataclasses import dataclass, field
from typing import NamedTuple

from andrea.experiments import paired

# the default model's shape (andrea-tiny: d_model 128, 4 heads, context 128, batches of 16 x 128 tokens),
# spelled out so that the experiments keep their budget if the default changes; each experiment's budget
# (200 steps, 410k tokens, at 12 blocks; 300 at 4 and 6; norm's 400 at 6) is meant to end every arm that
# trains (ends under the baseline at all: report.learned_line) LEARNED nats under the corpus's unigram
# baseline, and each report says which run did not (the first budget, 150 steps of a d_model 64 model on
# batches of 8 x 64 tokens, learned little more than the tokens' frequencies)
LEARNS = ["model.context_length=128", "model.d_model=128", "model.n_head=4", "train.batch_size=16"]
# at least this many nats under the unigram baseline: a model that learned more than token frequencies
LEARNED = 1.0
# shallow stacks learn more slowly per step than 12 blocks: at 200 steps ReLU's seed 0 ended 0.967 nats
# under the baseline (the activation experiment's first run at LEARNS), so the experiments of 4 blocks
# (and composition's 6) train 300
SHALLOW_STEPS = 300


@dataclass
class Experiment:
    claim: str                     # the design document's claim, in English
    original: str                  # its words in the design document (Portuguese)
    base: list                     # overrides every arm shares
    arms: dict                     # arm name -> its own overrides
    steps: int                     # the default budget, in optimizer steps
    arm_steps: dict = field(default_factory=dict)  # arm -> its own default budget, where it is not `steps`
    seeds: list = field(default_factory=lambda: [0, 1, 2])
    judge: object = None           # rows -> Verdict
    short: str = ""                # the claim in a few words, for a --doc page's at-a-glance table
    probe: object = None           # a finished run's directory -> more numbers for its row
    figure: object = None          # (name, rows) -> PNG bytes, instead of draw's
    details: object = None         # rows -> more of the report (markdown)
    more: list = field(default_factory=list)  # [(what, judge)]: further verdicts read from the same runs


def arm_values(rows, arm, key):
    """The finite values of `key` over the seeds of `arm`."""
    return [r[key] for r in rows if r["arm"] == arm and r[key] is not None and math.isfinite(r[key])]


def arm_mean(rows, arm, key):
    values = arm_values(rows, arm, key)
    return statistics.fmean(values) if values else math.nan


def seed_spread(rows, arms, key="val_loss"):
    """The seeds' spread: the widest range (max - min over the seeds) among `arms`, over the runs that
    did not diverge (two runs at lr 3e-2 without LayerNorm ended at losses of 5e7 and 2e10); nan when
    no arm has two such seeds. A description of the arms (the report's second table): the verdicts
    read the paired differences (andrea.experiments.paired) instead."""
    kept = [r for r in rows if not r.get("diverged")]
    ranges = [max(v) - min(v) for v in (arm_values(kept, a, key) for a in arms) if len(v) > 1]
    return max(ranges) if ranges else math.nan


class Verdict(NamedTuple):
    """What a rule returns: its verdict, the figures it read in words, and the same in a few words."""
    verdict: str   # "supports", "contradicts" or "leaves open"
    why: str       # for results.md and a --doc section's verdict line
    glance: str    # for the at-a-glance table of a --doc page


class Margin(NamedTuple):
    """How much worse (in nats of final validation loss) a claim of "no worse" or "comparable" lets
    an arm end, and why that much: fixed in the experiment's definition, before its runs are read."""
    nats: float
    why: str


# the margin of the claims of "no worse" and "comparable capacity": fixed with the paired rule, from
# what a difference in loss means, not from any run's differences
NO_WORSE = Margin(0.05, "a 5% change in perplexity (e^0.05 = 1.051), and a twentieth of the "
                        f"{LEARNED:.0f} nat that every run is budgeted to learn beyond the tokens' frequencies")


def kept_from_page(rule):
    """Marks a rule that compares no arms' final losses but reads a threshold in every seed's run (the
    gradient's ratios, the sublayers' changes, the logit lens, attention): the paired rule did not
    change it, and a --doc page prints its readings rounded or not at all, so --from-doc keeps its
    verdict as the runs' report wrote it (andrea.experiments.page)."""
    rule.kept_from_page = True
    return rule


def lower_claim(rows, lower, higher, names=None) -> Verdict:
    """The verdict on a claim that arm `lower` ends at a lower validation loss than arm `higher`:
    the per-seed differences higher - lower and their t-interval (paired.directional); `names`
    gives the arms' names in the text (default: the arms')."""
    iv = paired.paired(rows, lower, higher, names and f"{names[1]} - {names[0]}")
    verdict = paired.directional(iv)
    settle = paired.settle_words(iv) if verdict == "leaves open" else ""
    return Verdict(verdict, paired.words(iv) + settle, f"{iv.what}: {paired.short(iv)}")


def no_worse_claim(rows, base_arm, arm, margin: Margin, names=None) -> Verdict:
    """The verdict on a claim that `arm` ends no worse than `base_arm` by more than the margin: the
    per-seed differences arm - base_arm and where their t-interval lies against it (paired.no_worse)."""
    iv = paired.paired(rows, base_arm, arm, names and f"{names[1]} - {names[0]}")
    verdict = paired.no_worse(iv, margin.nats)
    settle = paired.settle_words(iv, margin.nats) if verdict == "leaves open" else ""
    return Verdict(verdict, paired.words(iv) + f", against the margin {margin.nats:g} nats ({margin.why})" + settle,
                   f"{iv.what}: {paired.short(iv)}, margin {margin.nats:g}")


def unlearned(rows):
    """The runs that did not diverge yet end less than LEARNED nats under their unigram baseline
    (issue 28: a verdict counts only from models that learned). Added after the first composition
    run, whose 50-step model (6.936 nats, baseline 6.683) still attended uniformly: its bands were
    noise, which the rules read as verdicts."""
    return [r["run"] for r in rows if r.get("unigram_baseline") is not None and not r["diverged"]
            and not r["val_loss"] <= r["unigram_baseline"] - LEARNED]


def not_learned(rows, why, glance):
    """A "leaves open" Verdict naming the runs that did not learn, or None when every run learned."""
    runs = unlearned(rows)
    if not runs:
        return None
    return Verdict("leaves open", why + f" (not decided: {', '.join(runs)} did not end {LEARNED} nats under the "
                                        "unigram baseline)", glance + "; a run did not learn")


def fmt(x, digits=3):
    if x is None:
        return "never"
    if isinstance(x, float):
        return "nan" if not math.isfinite(x) else f"{x:.{digits}g}" if abs(x) < 0.01 else f"{x:.{digits}f}"
    return str(x)


def png(fig):
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def logged(records, key, kind):
    """[(step, value)] of the steps whose record holds `key` as a `kind`, in step order."""
    return [(s, records[s][key]) for s in sorted(records) if isinstance(records[s].get(key), kind)]


def probe_counts(run_dir):
    """The run's parameter count and the first step its non-finite guard skipped (None: none did)."""
    from andrea.config import make_config
    from andrea.model.sizes import parameter_breakdown
    from andrea.run.metrics import by_step, read_records
    from andrea.run.runlog import read_saved_config

    cfg = make_config(read_saved_config(run_dir))
    records = read_records(run_dir / "metrics.jsonl", strict=True)
    # by_step leaves the skipped steps out: their records are read here
    first_bad = next((r.get("step") for r in records if r.get("skipped")), None)
    flows = logged(by_step(records), "grad_flow", dict)
    stream = max((v for _, f in flows[-1:] for v in f["stream_rms"] if v is not None), default=math.nan)
    return {"params": parameter_breakdown(cfg.model)["total"], "n_layer": cfg.model.n_layer,
            "first_nonfinite": first_bad, "stream_rms_last": stream}


def details_counts(rows):
    head = "\n| run | parameters | first non-finite step | largest stream RMS, last log |\n|---|---|---|---|\n"
    return head + "".join(
        f"| {r['run']} | {r['params']:,} | {fmt(r['first_nonfinite'])} | {fmt(r['stream_rms_last'])} |\n"
        for r in rows)
