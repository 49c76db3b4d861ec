"""What a preparation is asked, in the terms `prepare` and `train` share: where the data directory is
when none is named, and the range of the validation fraction.

    default_data_dir(["books/"])       # data/books: prepare --input books/ and train's data.inputs=books/ alike
    check_val_fraction(0.01, "--val-fraction")

Both commands call these (andrea/prepare.py, andrea/config.py's DataConfig), so a corpus prepared by
one is found by the other. Only the standard library is imported here: the config reads this module.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from andrea.errors import UserError

# Validation takes this share of the corpus. For the stdlib, 1% of the files is dominated by one file
# of doctests, whose loss stands well above the training windows'; 5% comes much closer
# (BENCHMARKS.md, "The default run").
VAL_FRACTION = 0.01
STDLIB_VAL_FRACTION = 0.05
# More than half the corpus held out leaves less to train on than to measure: never what is meant.
MAX_VAL_FRACTION = 0.5


def default_data_dir(inputs: list[str] | None) -> Path:
    """data/stdlib for the default corpus; data/<name> for one input (its file stem or directory
    name, up to any glob character); data/custom for several."""
    if not inputs:
        return Path("data/stdlib")
    if len(inputs) > 1:
        return Path("data/custom")
    fixed = re.split(r"[*?\[]", inputs[0], maxsplit=1)[0]
    path = Path(os.path.abspath(os.path.expanduser(fixed or ".")))
    name = path.stem if fixed and not fixed.endswith(("/", os.sep)) and path.suffix else path.name
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")
    return Path("data") / (name or "custom")


def default_val_fraction(inputs: list[str] | None) -> float:
    return VAL_FRACTION if inputs else STDLIB_VAL_FRACTION


def check_val_fraction(value: float, name: str) -> float:
    """`value` when it is in (0, MAX_VAL_FRACTION), else a UserError naming the setting `name`."""
    if not 0.0 < value < MAX_VAL_FRACTION:
        raise UserError(f"{name} must be between 0 and {MAX_VAL_FRACTION:g} (both exclusive), got {value}")
    return value
