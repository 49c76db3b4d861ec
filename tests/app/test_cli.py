"""Small command-line tools: the parameter count and the config loader's messages and round trip."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from andrea import params
from andrea.config import load_config, make_config
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


def saved_and_read_back(cfg):
    """What a run's config.json (and its checkpoints' meta) gives back: the config through JSON."""
    return make_config(json.loads(json.dumps(cfg.to_dict())))


@settings(max_examples=30)
@given(seed=st.integers(0, 2**63 - 1))
def test_an_integer_override_is_read_exactly(seed):
    # issue 30, class 8: 9007199254740993 went through a float and was saved as ...992
    cfg = load_config("tiny", [f"train.seed={seed}"])
    assert cfg.train.seed == seed and saved_and_read_back(cfg).train.seed == seed


def test_whole_numbers_are_read_in_any_notation_and_nothing_else_is():
    assert load_config("tiny", ["train.max_steps=2e3"]).train.max_steps == 2000
    assert load_config("tiny", ["train.seed=9007199254740993"]).train.seed == 9007199254740993
    for bad in ("inf", "nan", "1e999999999", "0x10", "2.5"):
        with pytest.raises(UserError, match=f"train.seed must be an integer, got '{bad}'"):
            load_config("tiny", [f"train.seed={bad}"])


@pytest.mark.parametrize("overrides", [
    ["model.d_model=56", "model.mlp_dim=115"],        # a width no float ratio gives back exactly
    ["model.mlp_ratio=2"], ["model.mlp_ratio=1.5"], ["model.mlp_dim=3"],
    ["train.seed=9007199254740993", "train.lr=1e-3", "train.min_lr=1.1e-4", "data.val_fraction=0.1",
     "train.sample_prompt=1e3", "data.inputs=a,b", "train.tf32=yes"],
])
def test_every_config_value_survives_its_own_config_json(overrides):
    # issue 30, class 8: a run of --set model.mlp_dim=115 (d_model 56) trained, but its saved config
    # (mlp_ratio 2.0535714285714284) was refused by --resume, sample and export
    cfg = load_config("tiny", overrides)
    back = saved_and_read_back(cfg)
    assert back.to_dict() == cfg.to_dict() and back.name == "andrea-tiny"
    assert saved_and_read_back(back).to_dict() == cfg.to_dict()  # and again
    from andrea.config import saved_model_config  # what a checkpoint's model config is compared as

    assert saved_model_config(cfg.to_dict()["model"]) == cfg.to_dict()["model"]


def test_mlp_ratio_and_mlp_dim_given_together_must_agree_whatever_the_ratio():
    assert load_config("tiny", ["model.mlp_dim=512", "model.mlp_ratio=4"]).model.mlp_dim == 512
    # what runs saved before the ratio was left out of config.json hold: the ratio mlp_dim / d_model
    saved = {"model": {"d_model": 56, "n_head": 4, "mlp_dim": 115, "mlp_ratio": 115 / 56}}
    assert make_config(saved).model.mlp_dim == 115
    # a saved config's width stays as it is when d_model changes, as in a YAML that gives mlp_dim
    assert make_config(json.loads(json.dumps(load_config("tiny").to_dict())), ["model.d_model=64"]).model.mlp_dim == 512
    # an explicit 4 was taken for "not given" and silently replaced by mlp_dim / d_model
    with pytest.raises(UserError, match=r"model.mlp_dim \(100\) and model.mlp_ratio \(4.0\) disagree"):
        load_config("tiny", ["model.mlp_dim=100", "model.mlp_ratio=4"])


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


@pytest.mark.parametrize("module", ["andrea.interop.torch_reference", "andrea.run.allreduce",
                                    "minitensor.checks.__main__", "andrea.trace", "andrea.eval"])
def test_the_other_commands_answer_a_bad_flag_in_one_line(module, capsys):
    import importlib

    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main(["--bogus"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "usage:" not in err
