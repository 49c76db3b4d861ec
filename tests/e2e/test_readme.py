"""Every command the README and the guides in docs/ show runs as written, and every link resolves (issues 20, 29).

The commands are read from the ```bash blocks of README.md and of each docs/*.md (continuation lines
joined, comments dropped) and run in that order (DOCS) in one scratch directory that holds this
repository's packages, so that each finds what the ones before it made (the default run's checkpoint
for `sample`, `plot` and `export`; the prepared notes for the fine-tune). A command shown on several
pages runs once. Each command must match one rule of RULES, which says how it runs here: as written,
as written with a cheap variant appended (a couple of steps instead of 500, one validation batch), not
here because another test of the suite runs it (Elsewhere: that test file must still hold the command),
or not at all, for a stated reason (it needs a GPU, a network, a cluster or eight GPUs). A command added
to a page without a rule fails the test, so the table and the pages stay one list. The network step of
the fine-tune (downloading GPT-2) is replaced by a small random GPT-2 and a byte-level BPE tokenizer
that transformers saves the same way.

The links: every relative link and image of README.md, BENCHMARKS.md and docs/*.md must name a file or
directory of the repository, an anchor must be a heading of its page (GitHub's slugs), and a link whose
text names a function, class or method (`Ops.layernorm_backward`) must point to the file that defines
it, so docs/derivations.md's references to the code cannot rot silently.
"""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
from optional import require

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
DOCS = ["README.md", "docs/data.md", "docs/training.md", "docs/distributed.md", "docs/gpu.md",
        "docs/huggingface.md", "docs/architecture.md", "docs/derivations.md", "docs/experiments.md",
        "docs/trace.md", "docs/serving.md", "docs/evaluation.md"]
LINKED = DOCS + ["BENCHMARKS.md"]
TWO_STEPS = ["--max-steps", "2", "--set", "train.eval_batches=1"]  # a training command, cheaply: ~4 s less each
LOCAL_GPT2 = "a small random GPT-2 made by transformers"
NEEDS_GPU = "needs a GPU"


class Elsewhere(NamedTuple):
    """Not run here: the test file `path`, which holds `needle`, runs this command (or its function)."""
    path: str
    needle: str


# (pattern matched against the whole command, what to do): a list is appended to the command and
# it runs; a string is why it does not run here; LOCAL_GPT2 makes the local GPT-2 instead
RULES = [
    (r"python3 -m venv \.venv", "makes a virtual environment: .ci/run does that on every change"),
    (r"(\.venv/bin/)?pip install .*", "installs packages: .ci/run installs the dev extra"),
    (r"(\w+=\S+ )*(\.venv/bin/)?python -m pytest -q.*", "the test suite this test is part of (or a part of it)"),
    (r"(\.venv/bin/)?python -m andrea\.train", TWO_STEPS),
    (r"python -m andrea\.prepare .*", []),
    (r"ls \S+", []),
    (r"python -m andrea\.train --out out/code .*", TWO_STEPS),
    (r"python -m andrea\.train --config small --out out/small .*", TWO_STEPS),
    (r"python -m andrea\.train --out out/small --resume .*", ["--max-steps", "4", "--set", "train.eval_batches=1"]),
    (r"python -m andrea\.train --config 120m --dry-run", []),
    (r"python -m andrea\.train --set \S+ --out out/[\w-]+", TWO_STEPS),
    (r"python -m andrea\.experiment \S+( --seeds \S+)?",
     Elsewhere("tests/e2e/test_experiment.py", "def test_each_experiment_runs_and_reports")),
    (r"python -m andrea\.experiment residual", ["--steps", "2", "--seeds", "0", "--set", "train.eval_batches=1"]),
    (r"python -m andrea\.experiment residual --scale .*",
     Elsewhere("tests/e2e/test_experiment.py", "def test_each_experiment_runs_and_reports")),
    (r"python -m andrea\.experiment \S+ --report-only --doc docs/experiments\.md",  # it would rewrite this page
     Elsewhere("tests/e2e/test_experiment.py", "def test_report_only_writes_its_section_of_a_doc")),
    (r"python -m andrea\.experiment \S+ --seeds \S+ --doc docs/experiments\.md",  # it would rewrite this page
     Elsewhere("tests/e2e/test_experiment_runfile.py", "def test_seeds_added_to_a_page_whose_runs_are_gone")),
    (r"python -m andrea\.experiment \S+ --from-doc docs/experiments\.md",  # it would rewrite this page
     Elsewhere("tests/e2e/test_experiment_sessions.py", "def test_a_page_written_by_the_spread_rule_is_judged_again")),
    (r"ANDREA_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python -m andrea\.experiment \S+ --arms \S+ --seeds \S+",
     Elsewhere("tests/e2e/test_experiment.py", "def test_arms_then_report_only_rebuild_the_report_from_finished_runs")),
    (r"python -m andrea\.experiment (no-)?norm --out runs/[\w-]+ --arms \S+ --seeds [\d,]+ --steps \d+( --set \S+)*",
     Elsewhere("tests/e2e/test_experiment.py", "def test_arms_then_report_only_rebuild_the_report_from_finished_runs")),
    (r"python -m andrea\.train .*--device gpu.*", ["--dry-run"]),  # exit 2 without a GPU: checked below
    (r"python -m andrea\.(sample|plot|export|params) .*", []),
    (r"python -m andrea\.trace --checkpoint RUN_OR_HF_DIR .*", "a synopsis: its words in capitals name the arguments"),
    (r"python -m andrea\.trace --checkpoint out/andrea-tiny .*", []),
    (r"python -m andrea\.eval RUN_OR_HF_DIR .*", "a synopsis: its words in capitals name the arguments"),
    (r"python -m andrea\.eval out/andrea-tiny --data-dir data/stdlib", ["--max-tokens", "4000"]),
    (r"python -m andrea\.bench", ["--configs", "tiny", "--no-allreduce"]),
    (r"python -m andrea\.bench --components", ["--repeats", "1"]),
    (r"python -m andrea\.run\.stepmodel", []),
    (r"python -m andrea\.run\.stepmodel --count-kernels",  # it would rewrite andrea/run/kernel_counts.json
     Elsewhere("tests/gpu/test_stepmodel.py", "def test_the_kept_kernel_counts_are_those_of_the_present_kernels")),
    (r"python -m minitensor\.checks --counts",  # what .ci/run runs after the compile check, before the suite
     Elsewhere("tests/gpu/test_counts.py", "def test_counts_command_prints_every_kernel_asked")),
    (r"python -m andrea\.bench .*--device gpu", NEEDS_GPU),
    (r"python -m minitensor\.checks --check",  # NVRTC compiles, which .ci/run also runs before the suite
     Elsewhere("tests/gpu/test_kernels.py", "def test_every_kernel_compiles_with_nvrtc")),
    (r"bash scripts/gpu_check\.sh", NEEDS_GPU),
    (r"bash scripts/gpu_check\.sh --dry-run",
     Elsewhere("tests/gpu/test_gpu_check.py", 'subprocess.run(["bash", str(SCRIPT), "--dry-run"]')),
    (r"python -m andrea\.run\.allreduce --nccl-self-test", NEEDS_GPU),
    (r"python -c .*from_pretrained\('gpt2'\).*", LOCAL_GPT2),
    (r"python -c .*pipeline\('text-generation', model='out/andrea-tiny-hf'\).*", []),
    (r"python -m andrea\.train --init-from gpt2 .*", TWO_STEPS),
    (r"(\w+=\S+ )*mpiexec -n 4 python -m mpi4py -m andrea\.train .*", TWO_STEPS),
    (r"mpiexec -n 2 python -m mpi4py -m andrea\.train .* --dry-run", []),
    (r"mpiexec -n 2 python -m mpi4py -m andrea\.train .* --set train\.zero_stage=1",  # at a tiny size, against 1
     Elsewhere("tests/e2e/test_distributed.py", "def test_n_processes_train_the_model_one_process_trains")),
    (r"mpiexec -n 2 python -m mpi4py -m andrea\.train .* --set train\.check_collectives=true",  # with a planted
     Elsewhere("tests/e2e/test_distributed.py",                                                # mismatch there
               "def test_the_collective_order_check_names_a_collective_one_rank_adds_in_training")),
    (r"mpiexec -n 2 python -m andrea\.run\.allreduce --bench \d+", []),
    (r"mpiexec -n 2 python -m andrea\.run\.allreduce --step-wait tiny( --\w+ \d+)*", []),
    (r"mpiexec .* -hosts .*", "needs a cluster of two machines"),
    (r"mpiexec (-f|--hostfile) hostfile .*", "needs a cluster of machines (a hostfile)"),
    (r"mpiexec -n 8 .*--device gpu.*", "needs eight GPUs"),
    (r"(\.venv/bin/)?python -m andrea\.serve out/andrea-tiny",  # a server runs until stopped: that test starts one
     Elsewhere("tests/e2e/test_serve_command.py", "def test_the_page_streams_a_completion_and_traces_a_clicked_token")),
    (r"python -m andrea\.serve RUN_OR_HF_DIR .*", "a synopsis: its words in capitals name the arguments"),
    (r"curl .*http://127\.0\.0\.1:8000/.*",  # against a running server: that test runs each against its own
     Elsewhere("tests/app/test_serve.py", "def test_the_guides_curl_commands_and_python_example_run_as_written")),
    (r"python -m andrea\.prepare --input web\.jsonl --text-field text",  # a JSON Lines file that test writes
     Elsewhere("tests/app/test_sources.py", "def test_a_jsonl_corpus_prepares_then_trains_as_a_user_runs_it")),
    (r"python -m andrea\.train --out out/web --set data\.inputs=web\.jsonl --set data\.text_field=text",
     Elsewhere("tests/app/test_sources.py", "def test_a_jsonl_corpus_prepares_then_trains_as_a_user_runs_it")),
    # a wsd trunk of 10,000 steps and its branch: that test runs the same two commands on a small model
    (r"python -m andrea\.train (--set train\.schedule=wsd --max-steps|--resume-from \S+ --out \S+ --max-steps) .*",
     Elsewhere("tests/e2e/test_schedule_branch.py", "def test_a_wsd_decay_branched_from_a_stable_checkpoint")),
    # the metrics sinks: that test trains with both (W&B offline) and reads back what each wrote
    (r"(WANDB_MODE=offline )?python -m andrea\.train --set train\.log_to=\S+ --out out/\w+",
     Elsewhere("tests/e2e/test_metrics_sinks.py", "def test_tensorboard_and_wandb_hold_what_metrics_jsonl_holds")),
    (r"tensorboard --logdir \S+",  # a server that runs until stopped; that test reads its files with its reader
     Elsewhere("tests/e2e/test_metrics_sinks.py", "EventAccumulator")),
    (r"wandb sync \S+", "uploads to W&B: needs a network and an account"),
    # the benchmarks read the user's files: those tests write them in the published formats and run the command
    (r"python -m andrea\.eval out/andrea-tiny --task hellaswag --data \S+( --max-items \d+)?",
     Elsewhere("tests/app/test_eval_tasks.py", "def test_a_trained_model_scores_above_chance_on_an_easy_fixture")),
    (r"python -m andrea\.eval out/andrea-tiny --task core --data \S+",
     Elsewhere("tests/app/test_eval_tasks.py", "def test_core_reports_each_tasks_accuracy_its_centred_accuracy_and_core")),
    (r"lm_eval --model local-completions .*",  # against a running server, on a task of the user's: that test writes one
     Elsewhere("tests/app/test_serve_harness.py", "def test_lm_eval_local_completions_scores_a_local_task_through_the_server")),
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


def doc_commands():
    """(page, words) of every page's commands, in DOCS order."""
    return [(page, words) for page in DOCS for words in readme_commands((ROOT / page).read_text())]


def rule_for(words):
    line = " ".join(words)
    matches = [what for pattern, what in RULES if re.fullmatch(pattern, line, re.S)]
    assert matches, f"no rule in tests/e2e/test_readme.py for the documented command: {line}"
    return matches[-1]  # the most specific: later rules narrow earlier ones


def test_docs_lists_every_guide():
    assert sorted(DOCS[1:]) == sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))


def test_every_documented_command_has_a_rule():
    commands = doc_commands()
    assert len(commands) >= 50
    for page, words in commands:
        what = rule_for(words)
        if isinstance(what, Elsewhere):  # the test that runs it is still there and still runs it
            assert what.needle in (ROOT / what.path).read_text(), f"{page}: {' '.join(words)}: {what}"
    pages = {page for page, _ in commands}
    assert pages == set(DOCS), f"pages without a command: {set(DOCS) - pages}"  # each guide opens with commands


# the commands the README offers after its first one (which installs andrea alone) that need an
# extra of pyproject.toml, and the package of that extra each needs
NEEDS_EXTRA = {"pytest": ("test", "pytest"), "andrea.experiment": ("plot", "matplotlib"),
               "andrea.plot": ("plot", "matplotlib")}


def test_the_readme_says_in_one_place_which_extra_each_later_command_needs():
    readme = (ROOT / "README.md").read_text()
    install = readme_commands(readme)[1]
    assert install[-2:] == ["-e", "."], install  # the first command's venv: no extra
    note = readme[readme.index("The first installs andrea alone"):].split("\n\n")[0]
    offered = " ".join(" ".join(words) for words in readme_commands(readme)[2:])
    pyproject = (ROOT / "pyproject.toml").read_text()
    for command, (extra, package) in NEEDS_EXTRA.items():
        assert f"-m {command}" in offered, command
        assert f"`{command}`" in note and f"'.[{extra}]'" in note, command
        assert re.search(rf'^{extra} = \[[^]]*"{package}\b', pyproject, re.M), (extra, package)


# The pages speak of the project's state ("not yet run on a GPU"), never of who wrote or measured
# what ("the sessions that measured these").
AUTHORS = re.compile(r"\b(sessions?|we|our|lent to)\b", re.I)
NOT_YET_CHECKED = set()


@pytest.mark.parametrize("page", sorted(set(LINKED) - NOT_YET_CHECKED))
def test_the_pages_speak_of_the_project_not_of_who_wrote_it(page):
    text = (ROOT / page).read_text()
    assert [line for line in text.splitlines() if AUTHORS.search(line)] == []


# --- the links ---

LINK = re.compile(r"!?\[([^\]]*)\]\(([^)\s]+)\)")


def slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path):
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)  # no headings inside code
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def defines(path, name):
    """Whether the Python file defines `name` (a function, method, class or module-level name)."""
    return re.search(rf"^\s*(def|class) {re.escape(name)}\b|^{re.escape(name)} = ", path.read_text(), re.M)


def link_errors(page):
    errors = []
    text = re.sub(r"^```.*?^```", "", (ROOT / page).read_text(), flags=re.S | re.M)
    for label, target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        path = (ROOT / page).parent / file_part if file_part else ROOT / page
        if not path.exists():
            errors.append(f"{page}: [{label}]({target}): no such file")
            continue
        if anchor and anchor not in anchors(path):
            errors.append(f"{page}: [{label}]({target}): no heading #{anchor} in {file_part or page}")
        name = re.fullmatch(r"`([A-Za-z_][\w.]*)`", label)
        if name and path.suffix == ".py" and not defines(path, name.group(1).split(".")[-1]):
            errors.append(f"{page}: [{label}]({target}): {file_part} defines no {name.group(1).split('.')[-1]}")
    return errors


@pytest.mark.parametrize("page", LINKED)
def test_every_link_and_anchor_resolves(page):
    assert link_errors(page) == []


def test_the_link_check_catches_a_broken_link(tmp_path, monkeypatch):
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    (tmp_path / "code.py").write_text("class Ops:\n    def layernorm_backward(self):\n        pass\n")
    page.write_text("# A page\n\n## One section\n\n[ok](#one-section) [ok](../code.py) "
                    "[`Ops.layernorm_backward`](../code.py)\n[gone](missing.md) [bad](#no-section) "
                    "[`Ops.gelu_backward`](../code.py)\n```bash\n[not a link](nowhere.md)\n```\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    errors = link_errors("docs/page.md")
    assert len(errors) == 3
    assert "missing.md" in errors[0] and "#no-section" in errors[1] and "gelu_backward" in errors[2]


# --- the commands ---

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


NUMBER = r"\d+(?:,\d{3})*(?:\.\d+)?(?:e[-+]\d+)?"


def excerpt_patterns(text):
    """The README's excerpt of the default run (its ```text block), a pattern per line: any number
    where the excerpt has a number, any run of spaces for one; a line cut short ("| ...") matches
    the start of a printed line, another the whole of one."""
    block = re.search(r"^```text\n(.*?)^```", text, re.S | re.M).group(1)
    patterns = []
    for line in block.splitlines():
        cut = line.endswith("| ...")
        pieces = re.split(NUMBER, line.removesuffix("...") if cut else line)
        pattern = NUMBER.join(re.sub(r"(?:\\ )+", " +", re.escape(p)) for p in pieces)
        patterns.append((pattern.replace("on +cpu", "on +(?:cpu|gpu)"), cut))  # where the default run found itself
    return patterns


def excerpt_lines_not_printed(readme, stdout):
    """The lines of the README's excerpt that have the shape of no line the run printed."""
    printed = stdout.splitlines()
    return [pattern for pattern, cut in excerpt_patterns(readme)
            if not any((re.match if cut else re.fullmatch)(pattern, line) for line in printed)]


def test_the_excerpt_check_tells_a_changed_line():
    readme = ("```text\nstep      1/500 | loss 9.0644 | lr 6.00e-05 | grad norm 2.587 | ...\n"
              "step    100: val loss 5.6481 (2.1695 bits/byte)\nstep    100: val loss 5.6481\n```\n")
    printed = ("step      2/2 | loss 8.1234 | lr 6.00e-05 | grad norm 2.587 | 1,346 tok/s | ETA 1s\n"
               "step      2: val loss 7.1000 (2.5000 bits/byte)\n")
    missing = excerpt_lines_not_printed(readme, printed)
    assert missing == [excerpt_patterns(readme)[2][0]]  # the val line without bits per byte is not what runs print


def make_local_gpt2(cwd):
    """What the README's download makes (`gpt2/`: config, safetensors weights, GPT-2's tokenizer
    files), small and random, offline."""
    transformers = require("transformers")
    from hf_files import foreign_tokenizer

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


def scratch(tmp_path):
    """The scratch directory: this repository's packages, and "your own text" for the fine-tune."""
    for name in ("andrea", "minitensor", "tests", "configs"):
        (tmp_path / name).symlink_to(ROOT / name)
    notes = tmp_path / "notes" / "project"
    notes.mkdir(parents=True)
    for doc in ("README.md", "BENCHMARKS.md"):
        (notes / doc).write_text((ROOT / doc).read_text())


@pytest.mark.slow
def test_every_documented_command_runs_as_written(tmp_path):
    require("transformers")
    require("mpi4py")
    require("matplotlib")
    scratch(tmp_path)
    from minitensor.device import gpu_available

    done = set()
    for page, words in doc_commands():
        line, what = " ".join(words), rule_for(words)
        if line in done or isinstance(what, (str, Elsewhere)) and what != LOCAL_GPT2:
            continue
        done.add(line)
        if what == LOCAL_GPT2:
            make_local_gpt2(tmp_path)
            continue
        result = run(words, tmp_path, what)
        said = f"{page}: {line} {' '.join(what)}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
        assert "Traceback" not in result.stderr, said
        if "--device gpu" in line and not gpu_available():
            assert result.returncode == 2 and "no usable GPU" in result.stderr, said
            continue
        assert result.returncode == 0, said
        if re.fullmatch(r"(\.venv/bin/)?python -m andrea\.train", line):  # the default run, two steps of it
            assert excerpt_lines_not_printed((ROOT / "README.md").read_text(), result.stdout) == [], said
    # what the commands leave: the runs, their checkpoints, the exported models, the figure
    assert (tmp_path / "out" / "andrea-tiny" / "ckpt-00000002").is_dir()
    assert (tmp_path / "out" / "small" / "ckpt-00000004").is_dir()  # the resume went on from step 2
    assert (tmp_path / "out" / "notes-gpt2" / "ckpt-00000002").is_dir()
    assert (tmp_path / "out" / "small-dp4" / "ckpt-00000002").is_dir()
    assert json.loads((tmp_path / "out" / "andrea-tiny-hf" / "config.json").read_text())["model_type"] == "gpt2"
    assert (tmp_path / "out" / "notes-gpt2-hf" / "model.safetensors").is_file()  # export's default --out
    assert not list(tmp_path.glob("*-hf")), "an export outside out/, which git ignores"
    assert (tmp_path / "data" / "tests" / "meta.json").is_file()
    assert (tmp_path / "out" / "loss.png").stat().st_size > 0  # under out/, which git ignores


def test_an_export_goes_under_out_by_default(tmp_path):
    """`export --checkpoint out/andrea-tiny` wrote nothing into the repository's root: out/andrea-tiny-hf,
    under out/, which git ignores."""
    from andrea.export import default_out

    run = tmp_path / "out" / "andrea-tiny"
    (run / "ckpt-00000002").mkdir(parents=True)
    assert default_out(run) == default_out(run / "ckpt-00000002") == Path("out") / "andrea-tiny-hf"
    assert "/out/" in (ROOT / ".gitignore").read_text().split()


def test_the_readme_says_to_activate_the_venv_before_its_bare_python():
    readme = (ROOT / "README.md").read_text()
    first_bare = readme.index("\npython -m ")
    assert ".venv/bin/python" in readme[:first_bare] and "source .venv/bin/activate" in readme[:first_bare]


def test_the_serving_guide_installs_what_its_python_example_imports():
    """The `openai` example once needed a package that no serving instruction installed."""
    page = (ROOT / "docs" / "serving.md").read_text()
    installed = " ".join(" ".join(words) for words in readme_commands(page) if words[:2] == ["pip", "install"])
    imported = {m for block in re.findall(r"^```python\n(.*?)^```", page, re.S | re.M)
                for m in re.findall(r"^(?:from|import) (\w+)", block, re.M)}
    assert imported and "openai" in imported
    for module in imported - {"andrea", "json", "sys"}:
        assert re.search(rf"\b{module}\b", installed), f"docs/serving.md imports {module}; no pip install there has it"


def test_the_fast_tier_holds_andreas_own_logic_and_never_shrinks():
    """The fast tier was tests/engine alone (16 of 67 mutants of andrea's newer code caught), and shrinking
    made one fast failure a 5-minute one: the tier takes the schedules, sources, paired statistics and
    the server's engine too, without their slow tests, in the dev profile, which does not shrink."""
    from hypothesis import Phase, settings

    assert Phase.shrink not in settings.get_profile("dev").phases
    assert "python -m pytest -q --fast" in (ROOT / "README.md").read_text()
    command = [sys.executable, "-m", "pytest", "-q", "--fast", "--collect-only", "-p", "no:cacheprovider"]
    listed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0, listed.stdout[-2000:] + listed.stderr[-2000:]
    files = {line.split("::")[0] for line in listed.stdout.splitlines() if "::" in line}
    for part in ("tests/engine/", "tests/app/test_schedule.py", "tests/app/test_sources.py",
                 "tests/app/test_paired.py", "tests/app/test_serve.py"):
        assert any(name.startswith(part) for name in files), part
    assert not any(name.startswith(("tests/e2e/", "tests/model/", "tests/gpu/")) for name in files)
    assert "test_a_jsonl_corpus_prepares_then_trains_as_a_user_runs_it" not in listed.stdout  # slow: left out


def test_the_readme_says_how_long_its_long_commands_take():
    """The mpiexec example (a whole ANDREA-small run) and the experiments once came with no duration."""
    readme = (ROOT / "README.md").read_text()
    several = readme[readme.index("## Several processes or machines"):].split("\n## ")[0]
    assert re.search(r"about \d+ hours on 2 CPU cores", several) and "16.4M tokens" in several
    learn = readme[readme.index("## Learn the maths"):].split("\n## ")[0]
    assert re.search(r"\d+ min for all eight, so about \d+ min on 2 idle cores", learn)
