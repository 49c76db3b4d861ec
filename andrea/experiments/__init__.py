"""The design document's claims as experiments (the command: andrea/experiment.py).

Open them in this order:

    base.py         the Experiment record (a claim, its arms, its budget, its rule), the default
                    model's shape (LEARNS), and the words every rule is made of: a Verdict, a claim
                    that one arm ends lower, one of "no worse" within a Margin, the runs that did not learn
    paired.py       the statistics: per-seed differences, their t-interval, where it lies, the
                    seeds that would settle an open verdict
    residual.py     residual, depth        why skip connections
    norm.py         norm, no-norm          where LayerNorm goes, and what it is for
    mlp.py          activation, mlp-ratio, swiglu    the MLP's activation and expansion
    composition.py  composition            how the blocks compose (logit lens, attention distance)
    runs.py         training each arm and seed, resuming, the numbers of each run
    lock.py         which process trains which run of an --out
    report.py       the tables, figure and verdicts; results.md
    page.py         a --doc page: its sections, its at-a-glance table, its figures read back (--from-doc)
    runfile.py      the per-run figures a --doc page keeps beside it (experiments/NAME-runs.json)

Each claim's rule is its `judge_*` function's docstring, fixed before the runs; a rule rewritten says
why beside it. Adding an experiment: its arms and rule in one of the claims' modules, its entry in
that module's EXPERIMENTS.
"""

from andrea.experiments import composition, mlp, norm, residual

# in the design document's order
EXPERIMENTS = residual.EXPERIMENTS | norm.EXPERIMENTS | mlp.EXPERIMENTS | composition.EXPERIMENTS
