"""Small command-line tools: the parameter count and the config loader's messages."""

import pytest

from andrea import params
from andrea.config import load_config
from andrea.errors import UserError


def test_params_prints_the_exact_count_of_andrea_120m(capsys):
    params.main(["120m"])
    out = capsys.readouterr().out
    assert "92,331,264" in out and "85,054,464" in out and "7,087,872 each" in out


def test_shipped_configs_load_and_match_the_spec():
    tiny, small, big = (load_config(n) for n in ("tiny", "small", "120m"))
    assert (tiny.model.d_model, tiny.model.n_layer, tiny.model.n_head, tiny.model.context_length) == (128, 4, 4, 128)
    s = small.model
    assert (s.d_model, s.n_layer, s.n_head, s.context_length) == (384, 6, 6, 256)
    assert (big.model.d_model, big.model.n_layer, big.model.mlp_dim, big.model.context_length) == (768, 12, 3072, 1024)
    assert load_config("andrea-tiny").name == "andrea-tiny"


@pytest.mark.parametrize("override, message", [
    ("model.n_layr=2", "unknown key model.n_layr (did you mean 'n_layer'?)"),
    ("trian.lr=1", "unknown section 'trian' in override 'trian.lr=1' (did you mean 'train'?)"),
    ("train.max_steps=2.5", "train.max_steps must be an integer, got '2.5'"),
    ("train.tf32=maybe", "train.tf32 must be true or false"),
    ("lr=1", "must look like section.key=value"),
    ("train.min_lr=1", "train.min_lr must be in [0, train.lr]"),
])
def test_config_mistakes_say_what_to_fix(override, message):
    with pytest.raises(UserError) as err:
        load_config("tiny", [override])
    assert message in str(err.value)


def test_overrides_are_typed():
    cfg = load_config("tiny", ["train.lr=1e-3", "model.n_layer=2", "train.tf32=true", "data.inputs=a,b"])
    assert cfg.train.lr == 1e-3 and cfg.model.n_layer == 2 and cfg.train.tf32 is True
    assert cfg.data.inputs == ["a", "b"]


@pytest.mark.parametrize("value", ["abc", "", " ", "1.5", "2"])
def test_andrea_num_threads_is_checked_before_any_work(value, monkeypatch, capsys):
    from andrea.cli import run_cli
    from minitensor import parallel

    monkeypatch.setattr(parallel, "_threads", None)  # read the environment again
    monkeypatch.setenv("ANDREA_NUM_THREADS", value)
    with pytest.raises(SystemExit) as e:
        run_cli(params.main, ["tiny"])
    err = capsys.readouterr().err
    if value in ("", "2"):  # empty: unset
        assert e.value.code == 0 and err == ""
    else:
        assert e.value.code == 2 and err == f"error: ANDREA_NUM_THREADS={value!r} is not a whole number: set it " \
                                            "to the number of threads to use (1: no threading), or unset it\n"


@pytest.mark.parametrize("argv", [["--bogus"], [], ["--checkpoint"]])
def test_export_answers_a_bad_flag_in_one_line(argv, capsys):
    from andrea import export
    from andrea.cli import run_cli

    with pytest.raises(SystemExit) as e:
        run_cli(export.main, argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "usage:" not in err


@pytest.mark.parametrize("module", ["andrea.interop.torch_reference", "andrea.run.distributed", "minitensor.kernels",
                                    "andrea.trace", "andrea.eval"])
def test_the_other_commands_answer_a_bad_flag_in_one_line(module, capsys):
    import importlib

    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main(["--bogus"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "usage:" not in err
