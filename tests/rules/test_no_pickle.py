"""No file format may run code when read: nothing imports pickle, and every np.load refuses it."""

import re
from pathlib import Path

SOURCES = [p for d in ("andrea", "minitensor") for p in (Path(__file__).resolve().parents[2] / d).rglob("*.py")]


def test_sources_were_found():
    assert len(SOURCES) > 10


def test_no_module_imports_pickle():
    offenders = [p.name for p in SOURCES if re.search(r"^\s*(import|from)\s+(c?pickle|dill|joblib)\b",
                                                       p.read_text(), re.M)]
    assert offenders == []


def test_every_np_load_disallows_pickle():
    for p in SOURCES:
        for call in re.findall(r"np\.load\([^)]*\)", p.read_text()):
            assert "allow_pickle=False" in call, f"{p.name}: {call}"
