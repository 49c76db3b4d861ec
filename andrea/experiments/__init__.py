"""The design document's claims as experiments (the command: andrea/experiment.py).

Open them in this order:

    base.py         the Experiment record (a claim, its arms, its budget, its rule), the default
                    model's shape (LEARNS), and the words every rule is made of: an arm's mean over
                    its seeds, the seeds' spread, the runs that did not learn
    residual.py     residual, depth        why skip connections
    norm.py         norm, no-norm          where LayerNorm goes, and what it is for
    mlp.py          activation, mlp-ratio, swiglu    the MLP's activation and expansion
    composition.py  composition            how the blocks compose (logit lens, attention distance)
    runs.py         training each arm and seed, resuming, the numbers of each run
    report.py       the tables, figure and verdicts; results.md and a --doc page's section

Each claim's rule is its `judge_*` function's docstring, fixed before the runs; a rule rewritten says
why beside it. Adding an experiment: its arms and rule in one of the claims' modules, its entry in
that module's EXPERIMENTS.
"""

from andrea.experiments import composition, mlp, norm, residual

# in the design document's order
EXPERIMENTS = residual.EXPERIMENTS | norm.EXPERIMENTS | mlp.EXPERIMENTS | composition.EXPERIMENTS
