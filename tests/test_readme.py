"""Every command the README shows runs as written (issue 20, class 9), and so does its Python.

The commands are read from the README's ```bash blocks (continuation lines joined, comments
dropped) and run in README order in one scratch directory that holds this repository's packages,
so that each finds what the ones before it made (the default run's checkpoint for `sample`,
`plot` and `export`; the prepared notes for the fine-tune). Each command must match one rule of
RULES, which says how it runs here: as written, as written with a cheap variant appended (a couple
of steps instead of 500, one validation batch), or not at all, for a stated reason (it needs a network, a cluster or
eight GPUs). A command added to the README without a rule fails the test, so the table and the
README stay one list. The network step of the fine-tune (downloading GPT-2) is replaced by a small
random GPT-2 and a byte-level BPE tokenizer that transformers saves the same way.
"""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from optional import require

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
TWO_STEPS = ["--max-steps", "2", "--set", "train.eval_batches=1"]  # a training command, cheaply: ~4 s less each
LOCAL_GPT2 = "a small random GPT-2 made by transformers"

# (pattern matched against the whole command, what to do): a list is appended to the command and
# it runs; a string is why it does not run here; LOCAL_GPT2 makes the local GPT-2 instead
RULES = [
    (r"python3 -m venv \.venv", "makes a virtual environment: .ci/run does that on every change"),
    (r"(\.venv/bin/)?pip install .*", "installs packages: .ci/run installs the dev extra"),
    (r"(\.venv/bin/)?python -m pytest -q", "the test suite this test is part of"),
    (r"(\.venv/bin/)?python -m andrea\.train", TWO_STEPS),
    (r"python -m andrea\.prepare .*", []),
    (r"python -m andrea\.train --out out/code .*", TWO_STEPS),
    (r"python -m andrea\.train --config small --out out/small .*", TWO_STEPS),
    (r"python -m andrea\.train --config 120m --dry-run", []),
    (r"python -m andrea\.train --set \S+ --out out/[\w-]+", TWO_STEPS),
    (r"python -m andrea\.experiment \S+", ["--steps", "2", "--seeds", "0"]),
    (r"python -m andrea\.train .*--device gpu", ["--dry-run"]),  # exit 2 without a GPU: checked below
    (r"python -m andrea\.(sample|plot|export|params) .*", []),
    (r"python -m andrea\.bench", ["--configs", "tiny", "--no-allreduce"]),
    (r"python -m andrea\.bench --components", ["--repeats", "1"]),
    (r"python -m minitensor\.kernels --check", []),
    (r"python -c .*from_pretrained\('gpt2'\).*", LOCAL_GPT2),
    (r"python -m andrea\.train --init-from gpt2 .*", TWO_STEPS),
    (r"(\w+=\S+ )*mpiexec -n 4 python -m mpi4py -m andrea\.train .*", TWO_STEPS),
    (r"mpiexec .* -hosts .*", "needs a cluster of two machines"),
    (r"mpiexec -n 8 .*--device gpu.*", "needs eight GPUs"),
]


def readme_commands(text):
    """The commands of the ```bash blocks, each a list of words; `a && b` gives a and b."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        pending = ""
        for line in block.splitlines():
            pending = f"{pending}\n{line}" if pending else line
            if pending.endswith("\\"):
                pending = pending[:-1]
                continue
            try:
                words = shlex.split(pending, comments=True)
            except ValueError:  # a quote still open: the command goes on over the next line
                continue
            pending = ""
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                commands.append(words[:cut])
                words = words[cut + 1:]
    return commands


def rule_for(words):
    line = " ".join(words)
    matches = [what for pattern, what in RULES if re.fullmatch(pattern, line, re.S)]
    assert matches, f"no rule in tests/test_readme.py for the README's command: {line}"
    return matches[-1]  # the most specific: later rules narrow earlier ones


def test_every_readme_command_has_a_rule():
    commands = readme_commands((ROOT / "README.md").read_text())
    assert len(commands) >= 20
    for words in commands:
        rule_for(words)


def test_the_library_snippets_run_as_written(tmp_path):
    # issue 30, class 14: the snippet used idx and targets it never defined. Each ```python block of
    # the README runs in a fresh interpreter; a block that makes `loss` must give about ln V at
    # initialisation (GPT-2's init spreads the first prediction almost evenly over the V ids)
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)
    assert blocks
    check = "\nimport math\nif 'loss' in dir(): assert abs(loss - math.log(cfg.vocab_size)) < 0.5, loss\n"
    for block in blocks:
        result = subprocess.run([sys.executable, "-c", block + check], cwd=tmp_path, capture_output=True, text=True,
                                env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
        assert result.returncode == 0, f"{block}\n{result.stderr[-3000:]}"


def make_local_gpt2(cwd):
    """What the README's download makes (`gpt2/`: config, safetensors weights, GPT-2's tokenizer
    files), small and random, offline."""
    transformers = require("transformers")
    from test_hf import foreign_tokenizer

    directory = cwd / "gpt2"
    directory.mkdir()
    texts = [p.read_text() for p in sorted((ROOT / "andrea").rglob("*.py"))]
    vocab = foreign_tokenizer(directory, texts, vocab_size=600, transformers=transformers)
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=256, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=vocab - 1, eos_token_id=vocab - 1)
    transformers.GPT2LMHeadModel(config).save_pretrained(directory)


def run(words, cwd, extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    while words and re.fullmatch(r"\w+=\S*", words[0]):  # VAR=VALUE before the command
        key, value = words[0].split("=", 1)
        env[key] = value
        words = words[1:]
    program = {"python": sys.executable, ".venv/bin/python": sys.executable, "mpiexec": str(MPIEXEC)}
    words = [program.get(w, w) if i == 0 or w == "python" else w for i, w in enumerate(words)]
    return subprocess.run([*words, *extra], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_every_readme_command_runs_as_written(tmp_path):
    require("transformers")
    require("mpi4py")
    require("matplotlib")
    for name in ("andrea", "minitensor", "tests", "configs"):
        (tmp_path / name).symlink_to(ROOT / name)
    notes = tmp_path / "notes" / "project"  # "your own text" for the fine-tune
    notes.mkdir(parents=True)
    for doc in ("README.md", "BENCHMARKS.md"):
        (notes / doc).write_text((ROOT / doc).read_text())
    from minitensor.backend import gpu_available

    done = set()
    for words in readme_commands((ROOT / "README.md").read_text()):
        line, what = " ".join(words), rule_for(words)
        if line in done or isinstance(what, str) and what != LOCAL_GPT2:
            continue
        done.add(line)
        if what == LOCAL_GPT2:
            make_local_gpt2(tmp_path)
            continue
        result = run(words, tmp_path, what)
        said = f"{line} {' '.join(what)}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
        assert "Traceback" not in result.stderr, said
        if "--device gpu" in line and not gpu_available():
            assert result.returncode == 2 and "no usable GPU" in result.stderr, said
            continue
        assert result.returncode == 0, said
    # what the commands leave: the runs, their checkpoints, the exported model, the figure
    assert (tmp_path / "out" / "andrea-tiny" / "ckpt-00000002").is_dir()
    assert (tmp_path / "out" / "notes-gpt2" / "ckpt-00000002").is_dir()
    assert (tmp_path / "out" / "small-dp4" / "ckpt-00000002").is_dir()
    assert json.loads((tmp_path / "andrea-tiny-hf" / "config.json").read_text())["model_type"] == "gpt2"
    assert (tmp_path / "loss.png").stat().st_size > 0
