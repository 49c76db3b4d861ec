"""The start-up self-check of the fused kernels (minitensor/backends/selection.py,
where kernel selection lives) and the backend it builds.

The checks run on the CuPy stand-in (tests/support/gpu_standin.py): RawKernels through the launch
emulation, ElementwiseKernels as C++ on the host. A kernel made to disagree (a sign flipped in
its CUDA code) is refused, reported, and the Ops code takes its place; a whole model step with
every fused piece launches each fused kernel and equals the generic step. That every piece
passes its own check is in test_gpu_standin.py; the choice and its line are also checked with
stand-in checks here.
"""

import dataclasses
import json
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import reference as F
from gpu_standin import standin_cupy
from markers import needs_cxx
from optional import require
from procs import run_in_own_session

from minitensor.backends import cuda, fused_pieces, get_ops, selection
from minitensor.backends.cupy_ops import CupyOps
from minitensor.backends.ops import Ops
from minitensor.layers.layernorm import LayerNorm

FUSED = tuple(fused_pieces())  # the names of the fused pieces, from their records


@pytest.fixture
def cupy():
    with standin_cupy() as cupy:
        yield cupy


def stand_in_check(error):
    """A check whose 'fused' run (the piece in the backend's use) is off by `error` relative to its
    generic run."""
    def check(ops, rng):
        y = ops.xp.asarray(rng.standard_normal(50).astype(np.float32))
        return (y * (1 + error) if ops.in_use else y,)
    return check


def test_select_keeps_what_agrees_and_reports_what_does_not(cupy):
    checks = {"layernorm": stand_in_check(1e-7), "adamw": stand_in_check(1e-2), "bias_gelu": stand_in_check(0.0)}
    fused, line = selection.select_kernels("auto", cupy, checks)
    assert fused == ("layernorm", "bias_gelu")
    assert line.startswith("kernels: fused layernorm, bias_gelu; generic for adamw (failed its self-check: max error")


def test_a_check_that_raises_is_refused(cupy):
    def broken(ops, rng):
        if ops.in_use:
            raise RuntimeError("NVRTC said no\nmore")
        return (ops.xp.zeros(3),)

    fused, line = selection.select_kernels("auto", cupy, {"adamw": broken})
    assert fused == ()
    assert line == "kernels: fused none; generic for adamw (failed its self-check: RuntimeError: NVRTC said no)"


def test_modes_and_numpy(cupy):
    assert selection.select_kernels("fused", cupy) == (
        FUSED, f"kernels: fused {', '.join(FUSED)} (train.kernels=fused, not self-checked)")
    assert selection.select_kernels("generic", cupy) == ((), "kernels: generic (train.kernels=generic)")
    assert selection.select_kernels("auto", np) == ((), "kernels: generic (NumPy)")
    with pytest.raises(ValueError, match="kernels must be one of"):
        selection.select_kernels("fast", np)


def test_the_backend_is_built_with_its_kernels_once(cupy):
    """get_ops fixes the fused pieces when the backend is built: one instance per choice."""
    fused = get_ops(cupy, "fused")
    assert isinstance(fused, CupyOps) and fused.in_use == frozenset(FUSED)
    assert get_ops(cupy, "fused") is fused
    generic = get_ops(cupy, "generic")
    assert generic.in_use == frozenset() and generic.kernels_line == "kernels: generic (train.kernels=generic)"
    assert [generic.fused(name) for name in FUSED] == [False] * len(FUSED)
    # a GPU choice leaves the CPU's alone: its backend names its own kernels
    assert get_ops(np, "auto").kernels_line == get_ops(np).kernels_line != generic.kernels_line
    with pytest.raises(ValueError, match="unknown fused pieces"):
        CupyOps(cupy, fused=("gelu",))


def test_every_piece_has_a_sample_that_runs_on_the_ops_code():
    checks = {name: piece.sample for name, piece in fused_pieces().items()}
    assert len(checks) >= 5
    for name, check in checks.items():  # on NumPy the generic code: outputs finite and repeatable
        first, again = (check(Ops(np), np.random.default_rng(selection.SEED)) for _ in range(2))
        assert all(np.all(np.isfinite(a)) for a in first), name
        assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True)), name


@needs_cxx
@pytest.mark.parametrize("piece, spec, wrong", [
    ("layernorm", "LAYERNORM_FWD", ("* widen(w[j]) + widen(b[j])", "* widen(w[j]) - widen(b[j])")),
    ("layernorm", "LAYERNORM_BWD", ("- mg -", "+ mg -")),
    ("rmsnorm", "RMSNORM_FWD", ("* r * widen(w[j])", "* r + widen(w[j])")),
    ("rmsnorm", "RMSNORM_BWD", ("(g[k] - xhat[k] * mgx)", "(g[k] + xhat[k] * mgx)")),
    ("causal_softmax", "CAUSAL_SOFTMAX_BWD", ("(widen(dpr[j]) - dot)", "(widen(dpr[j]) + dot)")),
    ("flash_attention", "FLASH_BWD_DKV", ("(dpt[n][e] - delta_s[col])", "(dpt[n][e] + delta_s[col])")),
    ("flash_attention", "FLASH_FWD", ("acc[u][2 * h + 1] *= alpha", "acc[u][2 * h + 1] *= total[h]")),
    ("flash_attention", "FLASH_BWD_DQ", ("b[0] = s[(r0 + 2 * t) * LD + c0 + g];", "b[0] = s[(r0 + t) * LD + c0 + g];")),
    ("causal_softmax", "CAUSAL_SOFTMAX_FWD", ("j <= last ? exp_of", "j < last ? exp_of")),
    ("softmax_xent", "SOFTMAX_XENT_FWD", ("log_of(total) + top - picked", "log_of(total) + top + picked")),
    ("softmax_xent", "SOFTMAX_XENT_BWD", ("(probs - (col == targets[row]", "(probs + (col == targets[row]")),
    ("bias_gelu", "BIAS_GELU_FWD", ("y = h / ((T)1 + exp(", "y = x / ((T)1 + exp(")),
    ("bias_gelu", "BIAS_GELU_BWD", ("* (T)0.21406444881780073 +", "* (T)0.21406444881780073 -")),
    ("bias_gelu", "BIAS_GELU_BWD_FWD", ("y = h / den;", "y = x / den;")),
    ("adamw", "ADAMW_STEP", ("beta1 * m_in", "beta2 * m_in")),
    ("adamw", "ADAMW_STEP_COPY", ("copy = narrow_bf16(p1);", "copy = narrow_bf16(m1);")),
])
def test_a_kernel_made_to_disagree_is_replaced_by_the_generic_path(cupy, monkeypatch, piece, spec, wrong):
    module = sys.modules[fused_pieces()[piece].sample.__module__]  # the piece's, beside its .cu
    good = getattr(module, spec)
    code = good.operation if isinstance(good, cuda.ElementwiseSpec) else good.code
    assert wrong[0] in code
    monkeypatch.setattr(module, spec, dataclasses.replace(good, inline=code.replace(*wrong)))
    fused, line = selection.select_kernels("auto", cupy, {piece: fused_pieces()[piece].sample})
    assert line.startswith(f"kernels: fused none; generic for {piece} (failed its self-check: max error")
    assert fused == ()
    if piece == "layernorm":  # and the layer of a backend built with that choice runs the generic code
        rng = np.random.default_rng(0)
        x, w, b = rng.standard_normal((5, 16)), rng.standard_normal(16), rng.standard_normal(16)
        layer = LayerNorm(cupy.asarray(w), cupy.zeros(16), cupy.asarray(b), cupy.zeros(16),
                          ops=CupyOps(cupy, fused))
        y = layer.forward(cupy.asarray(x))
        want, _, _ = F.layernorm_forward(x, w, b)
        np.testing.assert_allclose(cupy.asnumpy(y), want, rtol=1e-12, atol=1e-12)


@needs_cxx
def test_a_model_step_with_the_flash_core_equals_the_generic_one(cupy):
    """ANDREA (2 blocks, heads of 16) forward and backward with every fused piece, the attention core
    chosen as in training (the flash kernels), against the generic code in float64."""
    from andrea import ANDREA, ModelConfig

    rng = np.random.default_rng(5)
    x = rng.integers(0, 13, (2, 21))
    results, launched = [], {}
    for kernels in ("generic", "fused"):
        cupy.standin.reset()
        m = ANDREA(ModelConfig(vocab_size=13, context_length=20, d_model=32, n_layer=2, n_head=2), device="gpu",
                   dtype="float64", seed=4, kernels=kernels)
        loss = float(m.loss(x[:, :-1], x[:, 1:]))
        m.zero_grad()
        m.backward(0.5)
        results.append((loss, cupy.asnumpy(m.params.grads)))
        launched[kernels] = {name for _, name, _ in cupy.standin.kernels}
    flash = {"flash_attention_fwd", "flash_attention_bwd_dq", "flash_attention_bwd_dkv"}
    assert flash <= launched["fused"] and not flash & launched["generic"]
    assert not {"causal_softmax_fwd", "causal_softmax_bwd"} & launched["fused"]  # no (T, T) scores
    (loss_g, grads_g), (loss_f, grads_f) = results
    assert loss_f == pytest.approx(loss_g, rel=1e-12)
    np.testing.assert_allclose(grads_f, grads_g, rtol=1e-10, atol=1e-13)


@needs_cxx
def test_a_whole_model_step_with_every_fused_piece_equals_the_generic_one(cupy, monkeypatch):
    """ANDREA (2 blocks) forward, backward and an AdamW step, with every fused piece and the dense
    attention core, against the generic code, in float64: the model's use of the fused paths."""
    from andrea import ANDREA, AdamW, ModelConfig
    from minitensor.layers.attention import CausalSelfAttention

    monkeypatch.setattr(CausalSelfAttention, "dense", True)
    rng = np.random.default_rng(3)
    x = rng.integers(0, 13, (2, 9))
    results, launched = [], {}
    for kernels in ("generic", "fused"):
        cupy.standin.reset()
        m = ANDREA(ModelConfig(vocab_size=13, context_length=8, d_model=8, n_layer=2, n_head=2), device="gpu",
                   dtype="float64", seed=4, kernels=kernels)
        loss = float(m.loss(x[:, :-1], x[:, 1:]))
        m.zero_grad()
        m.backward(0.5)
        grads = cupy.asnumpy(m.params.grads)
        AdamW(m, lr=1e-2).step(grad_scale=cupy.asarray(0.7))
        results.append((loss, grads, cupy.asnumpy(m.params.data)))
        launched[kernels] = {name for _, name, _ in cupy.standin.kernels}
    (loss_g, grads_g, p_g), (loss_f, grads_f, p_f) = results
    fused_kernels = {"layernorm_fwd", "layernorm_bwd", "layernorm_bwd_params", "causal_softmax_fwd",
                     "causal_softmax_bwd", "bias_gelu_fwd", "bias_gelu_bwd_fwd", "softmax_xent_fwd",
                     "softmax_xent_bwd", "adamw_step"}
    assert fused_kernels <= launched["fused"], fused_kernels - launched["fused"]
    every_piece_kernel = {spec.name for piece in fused_pieces().values() for spec in piece.kernels}
    assert not every_piece_kernel & launched["generic"], every_piece_kernel & launched["generic"]
    assert loss_f == pytest.approx(loss_g, rel=1e-12)
    np.testing.assert_allclose(grads_f, grads_g, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(p_f, p_g, rtol=1e-12, atol=1e-14)


# --- the faster path chosen by timing ------------------------------------------------------------

def tiny_sizes():
    from minitensor.backends.cuda import Sizes

    return Sizes(B=2, T=16, C=32, n_head=2, F=64, V=50, P=300)


class Clock:
    """time.perf_counter as the timing reads it, advanced by the timed runs alone: each run takes
    exactly what it says, however loaded the machine is."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    ticks = Clock()
    monkeypatch.setattr(selection, "time", types.SimpleNamespace(perf_counter=ticks))
    return ticks


def sleeper(name, fused_ms, generic_ms, clock):
    """A timed record whose run takes fused_ms on `clock` with its piece `name` in use, generic_ms
    without (the other pieces in use both times)."""
    def timed(ops, sizes):
        def run():
            clock.now += (fused_ms if ops.fused(name) else generic_ms) / 1e3
        return run
    return timed


def test_a_fused_piece_slower_than_the_generic_code_is_not_chosen(cupy, monkeypatch, clock):
    """With the run's sizes, `auto` times each piece that passed its check with it on and off and keeps
    it only where it is not slower; the line gives both times (on a GPU: the stand-in's times are the
    CPU's, so this one is told it is a GPU)."""
    monkeypatch.setattr(cupy, "STANDIN", False)
    checks = {"layernorm": stand_in_check(0.0), "bias_gelu": stand_in_check(0.0)}
    timers = {"layernorm": sleeper("layernorm", fused_ms=30, generic_ms=2, clock=clock),
              "bias_gelu": sleeper("bias_gelu", fused_ms=2, generic_ms=30, clock=clock)}
    fused, line = selection.select_kernels("auto", cupy, checks, sizes=tiny_sizes(), timers=timers)
    assert fused == ("bias_gelu",)
    assert line == "kernels: fused bias_gelu (2 ms against 30); generic for layernorm (slower: fused 30 ms, generic 2 ms)"
    # without the run's sizes (a model built outside training), nothing is timed
    assert selection.select_kernels("auto", cupy, checks, timers=timers)[0] == ("layernorm", "bias_gelu")


def test_on_the_standin_nothing_is_timed_and_the_line_says_so(cupy, clock):
    checks = {"layernorm": stand_in_check(0.0)}
    fused, line = selection.select_kernels("auto", cupy, checks, sizes=tiny_sizes(),
                                           timers={"layernorm": sleeper("layernorm", 30, 2, clock)})
    assert fused == ("layernorm",) and line.endswith("(not timed: the CuPy stand-in runs the kernels on the CPU)")
    assert clock.now == 0.0


@needs_cxx
@pytest.mark.parametrize("name", FUSED)
def test_every_pieces_timed_run_runs_with_the_piece_and_without(cupy, name):
    """Each record's `timed` (what the start-up timing runs at the run's sizes, never run in CI on a GPU)
    runs through the backend both ways here, at tiny sizes."""
    piece = fused_pieces()[name]
    assert piece.timed is not None, f"{name}: its record has no timed run"
    with_piece, without = selection.time_piece(piece.timed, name, cupy, tiny_sizes())
    assert with_piece > 0 and without > 0


def test_a_piece_whose_timing_raises_runs_the_generic_code_and_the_line_says_why(cupy, monkeypatch, clock):
    """An out-of-memory or launch error while timing at the run's sizes is one piece's fallback, not
    the end of the model's construction; the pieces timed without error keep their verdict."""
    monkeypatch.setattr(cupy, "STANDIN", False)

    def out_of_memory(ops, sizes):
        raise MemoryError("Out of memory allocating 4,294,967,296 bytes\n(allocated so far: 77 GiB)")

    checks = {"layernorm": stand_in_check(0.0), "bias_gelu": stand_in_check(0.0)}
    timers = {"layernorm": out_of_memory, "bias_gelu": sleeper("bias_gelu", fused_ms=1, generic_ms=20, clock=clock)}
    fused, line = selection.select_kernels("auto", cupy, checks, sizes=tiny_sizes(), timers=timers)
    assert fused == ("bias_gelu",)
    assert line.endswith("; generic for layernorm (timing failed at the run's sizes, MemoryError: Out of memory "
                         "allocating 4,294,967,296 bytes)"), line
    assert "\n" not in line


@pytest.mark.parametrize("fused_s, generic_s, kept", [(2e-3, 2e-3, True), (2e-3 + 1e-9, 2e-3, False),
                                                      (2e-3 - 1e-9, 2e-3, True)])
def test_the_timing_tie_rule_keeps_the_fused_piece_only_when_it_is_not_slower(cupy, monkeypatch,
                                                                              fused_s, generic_s, kept):
    """Equal times keep the fused piece; a nanosecond slower refuses it."""
    monkeypatch.setattr(selection, "time_piece", lambda *a, **k: (fused_s, generic_s))
    refused = {}
    chosen, times = selection.keep_faster(["layernorm"], refused, cupy, tiny_sizes(), {"layernorm": None})
    assert times == {"layernorm": (fused_s, generic_s)}
    assert chosen == (["layernorm"] if kept else []) and ("layernorm" in refused) is not kept


def test_the_attention_sample_runs_at_the_runs_head_size():
    """With the run's sizes the self-check compares the flash core at the run's head size (64 for
    ANDREA-120M, the tensor-core path a run takes); without, or at one the kernels do not take, at 16."""
    from minitensor.backends.cuda import Sizes

    sample = fused_pieces()["flash_attention"].sample
    for sizes, width in ((Sizes(), 4 * 64), (None, 4 * 16), (tiny_sizes(), 4 * 16)):
        y = selection.at_sizes(sample, sizes)(Ops(np), np.random.default_rng(0))[0]
        assert y.shape == (2, 72, width), (sizes, y.shape)
    plain = stand_in_check(0.0)
    assert selection.at_sizes(plain, Sizes()) is plain  # a sample that takes no sizes runs as it is


def test_auto_with_the_runs_sizes_checks_each_sample_at_them(cupy, monkeypatch):
    """select_kernels hands the run's sizes to every sample that takes them (the flash core's at the
    run's head size), and runs the others as they are."""
    from minitensor.backends.cuda import Sizes

    seen = []

    def sized(ops, rng, sizes=None):
        seen.append(None if sizes is None else sizes.hs)
        return stand_in_check(0.0)(ops, rng)

    real = fused_pieces()
    pieces = {"layernorm": dataclasses.replace(real["layernorm"], sample=sized),
              "bias_gelu": dataclasses.replace(real["bias_gelu"], sample=stand_in_check(0.0))}
    monkeypatch.setattr(selection, "fused_pieces", lambda: pieces)
    fused, _ = selection.select_kernels("auto", cupy, sizes=Sizes())  # on the stand-in: checked, not timed
    assert fused == ("layernorm", "bias_gelu") and seen == [64, 64]  # the piece off, then on
    seen.clear()
    selection.select_kernels("auto", cupy)
    assert seen == [None, None]


def test_a_choice_made_elsewhere_builds_the_backend_unchecked(cupy, monkeypatch):
    """get_ops with rank 0's Choice runs exactly its pieces, logs its line, and runs no self-check."""
    monkeypatch.setattr(selection, "select_kernels", lambda *a, **k: pytest.fail("a Choice is not re-checked"))
    choice = selection.Choice(("layernorm",), "kernels: fused layernorm (rank 0's choice)")
    ops = get_ops(cupy, choice)
    assert ops.in_use == frozenset({"layernorm"}) and ops.kernels_line == choice.line
    assert get_ops(cupy, choice) is ops
    assert selection.Choice.from_json(json.loads(json.dumps(choice.to_json()))) == choice
    assert get_ops(np, choice) is get_ops(np)  # on the CPU a GPU choice leaves the CPU's kernels alone


def agree_on_two_ranks(tmp_path, *extra):
    """tests/support/kernels_driver.py under `mpiexec -n 2`: each rank's {own, agreed} choice."""
    require("mpi4py")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, (root, root / "tests" / "support"))),
               OPENBLAS_NUM_THREADS="1", ANDREA_NUM_THREADS="1")
    cmd = [str(Path(sys.executable).parent / "mpiexec"), "-n", "2", sys.executable, "-m", "mpi4py",
           str(root / "tests" / "support" / "kernels_driver.py"), str(tmp_path), *extra]
    r = run_in_own_session(cmd, env, root, timeout=120)
    assert r.returncode == 0, r.stderr
    return [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in (0, 1)]


def test_two_ranks_whose_timings_disagree_use_rank_0s_choice(tmp_path):
    rank0, rank1 = agree_on_two_ranks(tmp_path)
    assert rank0["own"][0] == ["layernorm"] and rank1["own"][0] == []  # alone, they would differ
    assert rank0["agreed"] == rank1["agreed"]
    pieces, line = rank0["agreed"]
    assert pieces == ["layernorm"]
    assert line == "kernels: fused layernorm (1 ms against 2) (rank 0's choice, on all 2 processes)"


def test_a_timing_failure_on_rank_0_falls_back_on_every_rank(tmp_path):
    rank0, rank1 = agree_on_two_ranks(tmp_path, "--raise-on", "0")
    assert rank0["agreed"] == rank1["agreed"]
    pieces, line = rank0["agreed"]
    assert pieces == []
    assert line.startswith("kernels: fused none; generic for layernorm (timing failed at the run's sizes, "
                           "MemoryError: Out of memory allocating"), line
    assert rank1["own"][0] == []  # rank 1 timed it slower by itself: refused for another reason


BF16_RUN = dict(B=2, T=72, C=64, n_head=4, F=256, V=50, P=1000)  # heads of 16, as the sample's own default


@needs_cxx
@pytest.mark.parametrize("planted", [False, True])
def test_a_bf16_runs_self_check_runs_and_checks_the_bf16_flash_kernels(cupy, monkeypatch, planted):
    """A bf16 run's sizes (cuda.Sizes.precision) add a bfloat16 pass to the flash sample: the m16n8k16 kernels
    a bf16 step launches, against Ops' bf16 code at selection.BF16_RTOL (its worst, measured on the stand-in:
    0.51 of it). Planted, a forward that skips rescaling one accumulator column is refused by a bf16 run's
    check and unseen by a float32 run's, which never launches it."""
    from minitensor.backends import cuda
    from minitensor.backends.kernels import attention

    if planted:
        good = attention.FLASH16_FWD
        wrong = ("acc[u][2 * h + 1] *= alpha;", "acc[u][2 * h + 1] *= 1.0f;")
        assert good.code.count(wrong[0]) == 1
        monkeypatch.setattr(attention, "FLASH16_FWD", dataclasses.replace(good, inline=good.code.replace(*wrong)))
    checks = {}
    for precision in ("float32", "bf16"):
        sizes = cuda.Sizes(**BF16_RUN, precision=precision)
        check = selection.at_sizes(fused_pieces()["flash_attention"].sample, sizes)
        cupy.standin.reset()
        checks[precision] = selection.compare(check, "flash_attention", cupy)
        bf16_launched = {n for _, n, _ in cupy.standin.kernels if n.endswith("_bf16")}
        assert bf16_launched == ({"flash_attention_fwd_bf16", "flash_attention_bwd_dq_bf16",
                                  "flash_attention_bwd_dkv_bf16"} if precision == "bf16" else set()), bf16_launched
    assert checks["float32"][0], checks
    assert checks["bf16"][0] is not planted, checks
    if not planted:
        assert float(checks["bf16"][1].split()[2]) <= 0.75, checks  # with room: 0.51 measured


def test_a_bf16_model_is_built_with_a_bf16_runs_sizes(cupy, monkeypatch):
    """ANDREA(precision="bf16", batch=...) hands its precision to the self-check's sizes, so a bf16 run's
    start-up checks the kernels it will launch."""
    from andrea import ANDREA, ModelConfig
    from andrea.model import transformer

    asked = []
    get = transformer.get_ops
    monkeypatch.setattr(transformer, "get_ops",
                        lambda xp, kernels, sizes: (asked.append(sizes), get(xp, kernels, sizes))[1])
    cfg = ModelConfig(vocab_size=13, context_length=8, d_model=32, n_layer=1, n_head=2)
    for precision in ("bf16", None):
        ANDREA(cfg, device="gpu", kernels="generic", precision=precision, batch=2)
    assert [s.precision for s in asked] == ["bf16", "float32"] and asked[0].B == 2
