"""The fused GPU kernels (minitensor/backends/kernels/, registered in minitensor.backends.cuda) against
their NumPy formulas.

Without a GPU: each formula against the Ops code it stands for, on every CPU backend; NVRTC compiles every new
kernel; each elementwise operation runs as C++ on the host (and the check catches a slip in it);
each RawKernel runs on the host through `emulate_launch`, via its wrapper, against its formula.
On a GPU (marked `gpu`): every wrapper against its formula on hypothesis-drawn shapes, float64
within 1e-12 and float32 within float32 precision, and the registered sources are what CuPy
compiles.
"""

import dataclasses
import shutil

import numpy as np
import pytest
import reference as F
import strategies as S
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from markers import needs_cxx, needs_nvrtc

from minitensor.backends import all_kernels, cuda, cupy_ops, fused_pieces
from minitensor.backends.blocked import BlockedOps
from minitensor.backends.kernels import adamw, attention, causal_softmax, gelu, layernorm, linear, rmsnorm, softmax_xent
from minitensor.backends.numpy_ops import NumpyOps
from minitensor.backends.ops import Ops
from minitensor.checks import kernelcheck
from minitensor.flat import Params
from minitensor.layers.layernorm import LayerNorm
from minitensor.layers.loss import SoftmaxCrossEntropy
from minitensor.optim import AdamW

# The fused pieces' kernels, read from their records, and the Linear epilogue's
NEW_KERNELS = {**{spec.name: spec for piece in fused_pieces().values() for spec in piece.kernels},
               linear.BIAS_RESIDUAL_ADD.name: linear.BIAS_RESIDUAL_ADD}
ELEMENTWISE = sorted(n for n, spec in NEW_KERNELS.items() if isinstance(spec, cuda.ElementwiseSpec))
DTYPES = [np.float32, np.float64]



def assert_close(got, want, rtol=None, scale=None):
    """Norm-wise: max |got - want| <= rtol max(max |want|, scale); rtol 1e-12 for float64, 1e-5
    (about 80 float32 epsilons) for float32, against a float64 formula of the same inputs."""
    got = np.asarray(got)
    if rtol is None:
        rtol = 1e-12 if got.dtype == np.float64 else 1e-5
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    if want.size == 0:
        return
    bound = rtol * max(float(np.max(np.abs(want))), scale or 0.0, 1e-300)
    err = float(np.max(np.abs(got.astype(np.float64) - want)))
    assert err <= bound, f"max error {err:.3g} > {bound:.3g} (rtol {rtol:g})"


def normal(rng, shape, dtype, scale=1.0, shift=0.0):
    return (shift + scale * rng.standard_normal(shape)).astype(dtype)


def f64(a):
    return np.asarray(a, dtype=np.float64)


def test_new_kernels_are_registered():
    assert {"layernorm_fwd", "causal_softmax_recompute", "adamw_step", "bias_residual_add"} <= set(NEW_KERNELS)
    assert {"bias_gelu_fwd", "softmax_xent_bwd"} <= set(ELEMENTWISE) and "layernorm_bwd" not in ELEMENTWISE
    for name, spec in NEW_KERNELS.items():
        assert all_kernels()[name] is spec, name


def test_every_fused_piece_is_one_complete_record():
    """Every module of kernels/ that declares a record has it registered (kernels.load, no list); each
    record names Ops methods (or CupyOps' own) with a function of the method's own arguments after
    `ops`, kernels registered under their names (each in one piece, its source in its .cu file), a
    sample and, where given, gpu_check's cases."""
    import inspect

    from minitensor.backends import kernels

    pieces = fused_pieces()
    declaring = {m for m in kernels.load() if "cuda.fused_piece(" in (cuda.KERNEL_DIR / f"{m}.py").read_text()}
    assert {piece.sample.__module__.rsplit(".", 1)[1] for piece in pieces.values()} == declaring
    assert len(pieces) >= 6 and list(pieces) == sorted(pieces)  # the kernels line's order: by name
    owners = {}
    for name, piece in pieces.items():
        assert piece.name == name and piece.replaces and piece.kernels and callable(piece.sample)
        assert piece.cases is None or callable(piece.cases)
        for method, run in piece.replaces.items():
            wanted = list(inspect.signature(getattr(cupy_ops.CupyOps, method)).parameters.values())[1:]
            got = list(inspect.signature(run).parameters.values())
            assert got[0].name == "ops" and got[1:] == wanted, (name, method, got, wanted)
        for spec in piece.kernels:
            assert cuda.KERNELS[spec.name] is spec and owners.setdefault(spec.name, name) == name, spec.name
            assert spec.file and f"{cuda.MARK}{spec.name}" in (cuda.KERNEL_DIR / spec.file).read_text()
    with pytest.raises(ValueError, match="already registered"):
        cuda.fused_piece("adamw", {"adamw_step": print}, (layernorm.LAYERNORM_FWD,), pieces["adamw"].sample)
    with pytest.raises(ValueError, match="replaces must map each Ops method"):
        cuda.fused_piece("a_piece", ("adamw_step",), (), pieces["adamw"].sample)


def test_a_backend_binds_the_functions_of_the_pieces_it_runs_and_falls_back_where_they_say():
    """CupyOps binds each record's functions over the methods they replace only for the pieces it was
    built with; a function that returns cuda.FALLBACK hands the call to the method as it was, Ops' or
    another piece's (two pieces replace attention_backward, each for its own core's cache)."""
    import inspect

    from gpu_standin import standin_cupy

    with standin_cupy() as cupy:
        every, none = cupy_ops.CupyOps(cupy, fused=tuple(fused_pieces())), cupy_ops.CupyOps(cupy)
        for name, piece in fused_pieces().items():
            for method, run in piece.replaces.items():
                assert not hasattr(inspect.unwrap(getattr(none, method)), "runs"), (name, method)
                bound, seen = inspect.unwrap(getattr(every, method)), set()  # under the count of writes
                while hasattr(bound, "runs"):                 # the chain of pieces over this method
                    seen.add(bound.runs)
                    bound = bound.without
                assert run in seen and not hasattr(bound, "runs"), (name, method)
        x = cupy.asarray(np.ones((2, 3 * layernorm.LN_MAX_C), np.float32))  # rows too long for the kernel
        w, dw, db = (cupy.asarray(np.ones(x.shape[-1], np.float32)) for _ in range(3))
        y, mean, rstd = none.layernorm_forward(x, w, w, 1e-5)
        cupy.standin.reset()
        every.layernorm_backward(x, x, mean, rstd, w, dw, db)
        assert not cupy.standin.kernels                    # Ops' code ran: no layernorm_bwd launched


def test_a_new_piece_is_its_record_alone(monkeypatch):
    """A record registered (as a new kernels/NAME.py would register it) is chosen by name and bound by
    CupyOps with no other change: its function runs where it takes the arguments, the method as it was
    where it returns cuda.FALLBACK, and a backend built without the piece never calls it."""
    from gpu_standin import standin_cupy

    calls = []

    def relu_forward(ops, x):
        calls.append(x.shape)
        return cuda.FALLBACK if x.ndim != 2 else ops.xp.full(x.shape, 7.0)

    toy = cuda.FusedPiece("toy_relu", {"relu_forward": relu_forward}, (), sample=lambda ops, rng: ())
    monkeypatch.setitem(cuda.PIECES, "toy_relu", toy)
    with standin_cupy() as cupy:
        assert "toy_relu" in fused_pieces()
        ops, plain = cupy_ops.CupyOps(cupy, fused=("toy_relu",)), cupy_ops.CupyOps(cupy)
        x = cupy.asarray(np.array([[-1.0, 2.0]]))
        assert cupy.asnumpy(ops.relu_forward(x)).tolist() == [[7.0, 7.0]]
        assert cupy.asnumpy(ops.relu_forward(x[0])).tolist() == [0.0, 2.0]   # FALLBACK: Ops' ReLU
        assert cupy.asnumpy(plain.relu_forward(x)).tolist() == [[0.0, 2.0]]
    assert calls == [(1, 2), (2,)]


# --- The formulas against the layer code they stand for (NumPy, float64) -------------------------


@settings(max_examples=20)
@given(N=st.integers(1, 6), C=st.integers(1, 40), seed=S.seeds, mode=st.sampled_from(["ops", "numpy", "numba"]))
def test_layernorm_formulas_equal_the_layer(N, C, seed, mode):
    """The Ops code (what the kernels' self-check compares them with on a GPU, through CuPy) and
    the CPU backend's overrides of it against the textbook form."""
    rng = np.random.default_rng(seed)
    x, dy = normal(rng, (N, C), np.float64, 2.0, 0.5), normal(rng, (N, C), np.float64)
    w, b = normal(rng, C, np.float64, 0.5, 1.0), normal(rng, C, np.float64)
    dw, db = np.zeros(C), np.zeros(C)
    ops = {"ops": Ops(np), "numpy": NumpyOps(numba=False), "numba": NumpyOps(numba=True)}[mode]
    layer = LayerNorm(w, dw, b, db, ops=ops)
    y, mean, rstd = F.layernorm_forward(x, w, b)
    assert_close(layer.forward(x), y)
    assert_close(layer._cache.mean, mean)
    assert_close(layer._cache.rstd, rstd)
    dx, dw_ref, db_ref = F.layernorm_backward(dy, x, w, mean, rstd)
    assert_close(layer.backward(dy), dx, scale=float(np.max(np.abs(dy * w * rstd))))
    assert_close(dw, dw_ref)
    assert_close(db, db_ref)


@settings(max_examples=20)
@given(BH=st.integers(1, 3), T=st.integers(1, 9), seed=S.seeds)
def test_causal_softmax_formulas_equal_the_attention_code(BH, T, seed):
    """The blocked core's block softmax, its recompute and its backward (minitensor.backends.blocked)
    against Ops' causal softmax."""
    ops = BlockedOps(np)
    rng = np.random.default_rng(seed)
    s, dp = normal(rng, (BH, T, T), np.float64, 3.0), normal(rng, (BH, T, T), np.float64)
    p, lse = F.causal_softmax(s)
    got_lse = np.empty((BH, T, 1))
    assert_close(ops.block_softmax(s.copy()[None], 0, got_lse[None])[0], p)
    assert_close(got_lse, lse)
    again = ops.block_probs_again(s.copy()[None], 0, lse[None])[0]
    assert_close(again, F.causal_softmax_recompute(s, lse))
    d = dp.copy()
    ops.block_softmax_backward(d[None], p[None], (dp * p).sum(axis=-1, keepdims=True)[None])
    assert_close(d, F.causal_softmax_backward(dp, p), scale=float(np.max(np.abs(dp))))
    # the scale folds into the scores: softmax(scale s) and d/ds = scale * d/d(scale s)
    assert_close(F.causal_softmax(s, 0.3)[0], F.causal_softmax(0.3 * s)[0])
    assert_close(F.causal_softmax_backward(dp, p, 0.3), 0.3 * F.causal_softmax_backward(dp, p))


@settings(max_examples=20)
@given(B=st.integers(1, 3), T=st.integers(1, 4), V=st.integers(2, 11), seed=S.seeds)
def test_cross_entropy_formulas_equal_the_loss_layer(B, T, V, seed):
    rng = np.random.default_rng(seed)
    logits, targets = normal(rng, (B, T, V), np.float64, 4.0), rng.integers(0, V, (B, T))
    loss, probs, losses = F.softmax_xent_forward(logits, targets)
    layer = SoftmaxCrossEntropy(ops=Ops(np))
    assert_close(layer.forward(logits.copy(), targets), loss)
    assert_close(losses.mean(), loss)
    assert_close(layer._cache.saved.reshape(probs.shape), probs)  # Ops keeps the probabilities
    assert_close(layer.backward(0.7), F.softmax_xent_backward(probs, targets, 0.7))


@settings(max_examples=10)
@given(seed=S.seeds, steps=st.integers(1, 3), grad_scale=st.sampled_from([1.0, 0.3]))
def test_adamw_formula_equals_the_optimizer(seed, steps, grad_scale):
    rng = np.random.default_rng(seed)
    params = Params({"w": (3, 5), "b": (5,), "e": (4, 2)}, dtype="float64")
    params.data[...] = rng.standard_normal(params.size)  # the padding too: AdamW must leave it alone
    p, m, v = params.data.copy(), np.zeros(params.size), np.zeros(params.size)
    opt = AdamW(params, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    mask = params.mask(lambda name, shape: len(shape) >= 2)
    for t in range(1, steps + 1):
        for _, grad in params.grad_items():  # the padding's gradient stays 0, so the formula keeps it too
            grad[...] = rng.standard_normal(grad.shape)
        p, m, v = F.adamw(p, params.grads, m, v, mask, lr=0.01, beta1=0.9, beta2=0.95, eps=1e-8,
                          weight_decay=0.1, t=t, grad_scale=grad_scale)
        opt.step(grad_scale=grad_scale)
    assert_close(params.data, p, rtol=1e-12)
    assert_close(opt.named_state()["m"], m)
    assert_close(opt.named_state()["v"], v)


def test_adamw_kernel_form_equals_the_textbook_form():
    rng = np.random.default_rng(3)
    p, g, m = (rng.standard_normal(50) for _ in range(3))
    v, mask = np.abs(rng.standard_normal(50)), (rng.random(50) > 0.5).astype(float)
    b1, b2, lr, eps, wd, t = 0.9, 0.95, 3e-3, 1e-8, 0.1, 7
    c1, c2 = 1 - b1**t, 1 - b2**t
    want = F.adamw(p, g, m, v, mask, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, t=t, grad_scale=0.5)
    got = adamw._adamw_op_reference(p, m, v, g, mask, b1, b2, 0.5, lr * np.sqrt(c2) / c1, eps * np.sqrt(c2), lr * wd)
    for a, b in zip(got, want):
        assert_close(a, b)


def test_gelu_kernel_references_are_the_generic_code():
    """The references the host check holds the GELU kernels to, on flat arrays as the kernels see
    them: GELU's Ops code, equal to the textbook form; with the bias gathered by column, that
    code with the bias (Ops.bias_gelu_forward over rows, what an MLP runs without the kernel)."""
    rng = np.random.default_rng(4)
    x, b, dy = normal(rng, (3, 7), np.float64, 2.0), normal(rng, 7, np.float64), normal(rng, (3, 7), np.float64)
    flat_x, flat_dy = x.reshape(-1), dy.reshape(-1)
    assert_close(gelu.GELU_FWD.reference(x=flat_x), F.gelu(flat_x))
    assert_close(gelu.GELU_BWD.reference(x=flat_x, dy=flat_dy), F.gelu_backward(flat_x, flat_dy))
    y = gelu.BIAS_GELU_FWD.reference(x=flat_x, b=b, C=7.0).reshape(3, 7)
    h = x.copy()
    np.testing.assert_array_equal(y, Ops(np).bias_gelu_forward(h, b))
    assert_close(y, F.gelu(x + b))
    dh = gelu.BIAS_GELU_BWD.reference(x=flat_x, b=b, C=7.0, dy=flat_dy).reshape(3, 7)
    np.testing.assert_array_equal(dh, Ops(np).bias_gelu_backward(h, b, dy))
    assert_close(dh, F.gelu_backward(x + b, dy), scale=float(np.max(np.abs(dy))))


# --- Compile check and the host C++ check of the elementwise operations --------------------------


@needs_nvrtc
def test_every_new_kernel_compiles_for_both_dtypes_and_archs():
    specs = [all_kernels()[n] for n in NEW_KERNELS]
    results = list(kernelcheck.check_kernels(specs))
    assert len(results) == sum(len(s.dtypes) for s in specs) * 2
    assert [r.line() for r in results if not r.ok] == []
    bf16 = {s.name for s in specs if s.name.endswith("_bf16")}  # the bf16 flash kernels: in bfloat16 alone
    assert {(r.dtype, r.arch) for r in results if r.name not in bf16} >= {
        (d, a) for d in ("float32", "float64") for a in ("sm_80", "sm_90")}  # bfloat16 too for the row kernels
    assert {(r.dtype, r.arch) for r in results if r.name in bf16} == {("bfloat16", a) for a in ("sm_80", "sm_90")}


@needs_nvrtc
def test_elementwise_sources_pass_raw_arrays_and_scalars():
    src = gelu.BIAS_GELU_FWD.source("float32")
    assert "const CArray<float, 1, 1, 1> b, const int C," in src
    src = softmax_xent.SOFTMAX_XENT_BWD.source("float64")
    assert "const CArray<long long, 1, 1, 1> targets, const int V, const double scale," in src
    assert "const float beta1," in adamw.ADAMW_STEP.source("float32")


@needs_cxx
@pytest.mark.parametrize("name", ELEMENTWISE)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_new_elementwise_operation_equals_its_formula_as_cpp(name, dtype):
    result = kernelcheck.host_check(all_kernels()[name], dtype)
    assert result.ok, result.line()


SLIPS = {  # a plausible mistake in each operation, which the host check must catch
    "bias_gelu_fwd": ("b[(unsigned int)i % (unsigned int)C]", "b[0]"),
    "bias_gelu_bwd": ("((T)1 - sig) *", "sig *"),
    "bias_gelu_bwd_fwd": ("y = h / den", "y = h * den"),
    "bias_residual_add": (") + r;", ") - r;"),
    "causal_softmax_recompute": ("col <= row", "col < row"),
    "softmax_xent_bwd": ("col == targets[row]", "col == targets[0]"),
    "adamw_step": ("decay * mask", "decay"),
}


@needs_cxx
@pytest.mark.parametrize("name", sorted(SLIPS))
def test_host_check_catches_a_slip_in_each_operation(name):
    spec = all_kernels()[name]
    old, new = SLIPS[name]
    assert old in spec.operation
    slipped = dataclasses.replace(spec, name=name + "_slip", inline=spec.operation.replace(old, new))
    assert not kernelcheck.host_check(slipped, "float64").ok


# --- The RawKernels, through their wrappers, emulated on the host --------------------------------


@pytest.fixture
def emulated(monkeypatch):
    if shutil.which("g++") is None:
        pytest.skip("no g++ for the emulation")
    monkeypatch.setattr(cuda, "launch", kernelcheck.emulate_launch)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 1), (2, 3, 70)])  # one element a row; three warps, two passes
def test_layernorm_kernels_emulated(emulated, dtype, shape):
    rng = np.random.default_rng(5)
    C = shape[-1]
    x, dy, r = (normal(rng, shape, dtype, 2.0, 0.5) for _ in range(3))
    w, b = normal(rng, C, dtype, 0.5, 1.0), normal(rng, C, dtype)
    x2, dy2, r2 = (f64(a).reshape(-1, C) for a in (x, dy, r))  # the formulas take rows (N, C)
    y, mean, rstd = layernorm.layernorm_forward_gpu(x, w, b, 1e-5)
    y_ref, mean_ref, rstd_ref = F.layernorm_forward(x2, f64(w), f64(b))
    assert y.shape == x.shape and mean.shape == rstd.shape == (x2.shape[0], 1)
    assert_close(y.reshape(-1, C), y_ref)
    assert_close(mean, mean_ref, scale=1.0)
    assert_close(rstd, rstd_ref)

    dw, db = np.full(C, 0.5, dtype), np.full(C, -0.5, dtype)  # gradients accumulate
    dx = layernorm.layernorm_backward_gpu(dy, x, w, mean, rstd, dw, db)
    dx_ref, dw_ref, db_ref = F.layernorm_backward(dy2, x2, f64(w), mean_ref, rstd_ref)
    scale = float(np.max(np.abs(dy2 * f64(w) * rstd_ref)))
    assert_close(dx.reshape(-1, C), dx_ref, scale=scale)
    assert_close(dw, 0.5 + dw_ref, scale=1.0)
    assert_close(db, -0.5 + db_ref, scale=1.0)

    # fused residual joins: forward adds the residual into x first, backward adds dx into add_to
    xs = x.copy()
    y2, _, _ = layernorm.layernorm_forward_gpu(xs, w, b, 1e-5, residual=r, out=xs)
    assert y2 is xs
    assert_close(y2.reshape(-1, C), F.layernorm_forward(x2 + r2, f64(w), f64(b))[0])
    # with the sublayer's bias too: x becomes (x + bias) + r, Ops.add_epilogue's two adds bit for bit
    bias, xb, want = normal(rng, C, dtype), x.copy(), x.reshape(-1, C).copy()
    y3, _, _ = layernorm.layernorm_forward_gpu(xb, w, b, 1e-5, residual=r, bias=bias)
    Ops(np).add_epilogue(want, bias, r.reshape(-1, C))
    assert np.array_equal(xb.reshape(-1, C), want)
    assert_close(y3.reshape(-1, C), F.layernorm_forward(f64(want), f64(w), f64(b))[0])
    with pytest.raises(ValueError, match="give residual too"):
        layernorm.layernorm_forward_gpu(x.copy(), w, b, 1e-5, bias=bias)
    acc, acc_db = r.copy(), np.full(C, 0.25, dtype)  # with the column sums of what was added, accumulated
    assert layernorm.layernorm_backward_gpu(dy, x, w, mean, rstd, dw, db, add_to=acc, res_db=acc_db) is acc
    assert_close(acc.reshape(-1, C), r2 + dx_ref, scale=scale)
    assert_close(acc_db, 0.25 + r2.sum(axis=0), scale=1.0)
    # or residual + dx into a new array, the residual kept (the skip gradient needs no copy)
    kept, kept_db = r.copy(), np.zeros(C, dtype)
    joined = layernorm.layernorm_backward_gpu(dy, x, w, mean, rstd, dw, db, residual=kept, res_db=kept_db)
    assert joined is not kept and np.array_equal(kept, r)
    assert_close(joined.reshape(-1, C), r2 + dx_ref, scale=scale)
    assert_close(kept_db, r2.sum(axis=0), scale=1.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 1), (2, 3, 70), (40, 300)])  # one element a row; warps; chunks of rows
def test_rmsnorm_kernels_emulated(emulated, dtype, shape):
    """The kernels against Ops' methods on the same inputs in float64."""
    rng = np.random.default_rng(6)
    C = shape[-1]
    x, dy, r = (normal(rng, shape, dtype, 2.0, 0.5) for _ in range(3))
    w = normal(rng, C, dtype, 0.5, 1.0)
    x2, dy2, r2 = (f64(a).reshape(-1, C) for a in (x, dy, r))
    y, rstd = rmsnorm.rmsnorm_forward_gpu(x, w, 1e-5)
    y_ref, rstd_ref = Ops(np).rmsnorm_forward(x2, f64(w), 1e-5)
    assert y.shape == x.shape and rstd.shape == (x2.shape[0], 1)
    assert_close(y.reshape(-1, C), y_ref)
    assert_close(rstd, rstd_ref)
    dw, dw_ref = np.full(C, 0.5, dtype), np.full(C, 0.5)  # the gradient accumulates
    dx = rmsnorm.rmsnorm_backward_gpu(dy, x, w, rstd, dw)
    dx_ref = Ops(np).rmsnorm_backward(dy2, x2, rstd_ref, f64(w), dw_ref)
    scale = float(np.max(np.abs(dy2 * f64(w) * rstd_ref)))
    assert_close(dx.reshape(-1, C), dx_ref, scale=scale)
    assert_close(dw, dw_ref, scale=1.0)
    # residual + dx into a new array, the residual kept (a pre-norm block's skip gradient)
    kept = r.copy()
    joined = rmsnorm.rmsnorm_backward_gpu(dy, x, w, rstd, np.zeros(C, dtype), residual=kept)
    assert joined is not kept and np.array_equal(kept, r)
    assert_close(joined.reshape(-1, C), r2 + dx_ref, scale=scale)


@pytest.mark.parametrize("N, C, chunks, least", [
    (130, 40, None, None),  # the defaults: 16 rows a block, 9 blocks (more than the 8 rows of a column block)
    (37, 300, 4, 1),        # 10 rows a block, the last of 7; 3 columns a thread
    (5, 1900, 2, 1),        # 256 threads, 8 columns a thread (the last partly); 3 rows a block, the last of 2
    (1, 3, None, None),     # one row, one block
])
def test_layernorm_backward_over_several_row_chunks(emulated, monkeypatch, N, C, chunks, least):
    """layernorm_bwd's rows split into chunks (the partial parameter sums of each, in registers),
    layernorm_bwd_params adding them up: dx, dw and db against the formulas, the gradients accumulated."""
    if chunks:
        monkeypatch.setattr(layernorm, "LN_CHUNKS", chunks)
        monkeypatch.setattr(layernorm, "LN_CHUNK_ROWS", least)
    rng = np.random.default_rng(6)
    x, dy, r = (normal(rng, (N, C), np.float64) for _ in range(3))
    w, b = normal(rng, C, np.float64), normal(rng, C, np.float64)
    _, mean, rstd = F.layernorm_forward(x, w, b)
    dw, db, dr = np.full(C, 0.25), np.full(C, -0.75), np.full(C, 0.5)
    dx = layernorm.layernorm_backward_gpu(dy, x, w, mean, rstd, dw, db, residual=r, res_db=dr)
    dx_ref, dw_ref, db_ref = F.layernorm_backward(dy, x, w, mean, rstd)
    assert_close(dx, r + dx_ref, scale=float(np.max(np.abs(dy * w * rstd))))
    assert_close(dw, 0.25 + dw_ref)
    assert_close(db, -0.75 + db_ref)
    assert_close(dr, 0.5 + r.sum(axis=0))  # the residual's column sums, over every chunk


def test_layernorm_backward_kernel_refuses_rows_longer_than_its_registers_and_cupyops_falls_back():
    """Rows of more than LN_MAX_C values: layernorm_backward_gpu refuses them before any launch, and
    CupyOps.layernorm_backward computes them by Ops' code."""
    from gpu_standin import standin_cupy

    rng = np.random.default_rng(8)
    C = layernorm.LN_MAX_C + 1
    x, dy = rng.standard_normal((2, C)), rng.standard_normal((2, C))
    w = rng.standard_normal(C)
    _, mean, rstd = F.layernorm_forward(x, w, np.zeros(C))
    with pytest.raises(ValueError, match=f"at most {layernorm.LN_MAX_C}"):
        layernorm.layernorm_backward_gpu(dy, x, w, mean, rstd, np.zeros(C), np.zeros(C))
    want = Ops(np).layernorm_backward(dy, x, mean, rstd, w, np.zeros(C), np.zeros(C))
    with standin_cupy() as cupy:
        ops = cupy_ops.CupyOps(cupy, fused=("layernorm",))
        args = [cupy.asarray(a) for a in (dy, x, mean, rstd, w)]
        got = ops.layernorm_backward(*args, cupy.zeros(C), cupy.zeros(C)).get()
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 1, 1), (2, 5, 5), (1, 40, 40)])
def test_causal_softmax_kernels_emulated(emulated, dtype, shape):
    rng = np.random.default_rng(7)
    s, dp = normal(rng, shape, dtype, 3.0), normal(rng, shape, dtype)
    lse = np.full((*shape[:-1], 1), np.nan, dtype)
    p = causal_softmax.causal_softmax_forward_gpu(s, 0.3, lse=lse)
    p_ref, lse_ref = F.causal_softmax(f64(s), 0.3)
    assert_close(p, p_ref)
    assert np.all(p[..., np.triu_indices(shape[-1], 1)[0], np.triu_indices(shape[-1], 1)[1]] == 0)
    assert_close(lse, lse_ref, scale=1.0)
    ds = causal_softmax.causal_softmax_backward_gpu(dp, p, 0.3)
    assert_close(ds, F.causal_softmax_backward(f64(dp), p_ref, 0.3), scale=float(np.max(np.abs(dp))))
    inplace = s.copy()
    assert causal_softmax.causal_softmax_forward_gpu(inplace, 0.3, out=inplace) is inplace
    assert_close(inplace, p_ref)
    d = dp.copy()
    assert causal_softmax.causal_softmax_backward_gpu(d, p, 0.3, out=d) is d
    assert_close(d, F.causal_softmax_backward(f64(dp), p_ref, 0.3), scale=float(np.max(np.abs(dp))))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", [2, 7, 100])
def test_cross_entropy_forward_emulated(emulated, dtype, V):
    rng = np.random.default_rng(8)
    logits = normal(rng, (2, 3, V), dtype, 4.0, 10.0)  # large logits: the max is subtracted first
    targets = rng.integers(0, V, (2, 3)).astype(np.int32)  # any integer dtype: copied to int64
    z = logits.copy()
    loss, losses = softmax_xent.softmax_xent_forward_gpu(z, targets)
    loss_ref, probs_ref, losses_ref = F.softmax_xent_forward(f64(logits), targets)
    assert_close(losses, losses_ref, scale=1.0)
    assert_close(loss, loss_ref, scale=1.0)
    assert_close(z, probs_ref)  # the probabilities, over the logits


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_marks_a_bad_target_with_nan(emulated, dtype):
    logits = np.zeros((3, 4), dtype)
    _, losses = softmax_xent.softmax_xent_forward_gpu(logits, np.array([1, 4, -1]))
    assert losses[0] == pytest.approx(np.log(4)) and np.isnan(losses[1]) and np.isnan(losses[2])


# --- Argument checks ----------------------------------------------------------------------------


def attention_reference(q, k, v, dy):
    """(y, lse, dq, dk, dv) of the causal attention of unscaled q, k, v (BH, T, hs) through Ops' dense
    core in float64 (one head per batch row), lse from the formulas."""
    q, k, v, dy = (f64(a) for a in (q, k, v, dy))
    BH, T, hs = q.shape
    ops = Ops(np)
    y4 = np.empty((BH, 1, T, hs))
    cache = ops.attention_forward([a[:, None] for a in (q, k, v)], None, y4, dense=True)
    grads = [np.empty((BH, 1, T, hs)) for _ in range(3)]
    ops.attention_backward(dy[:, None], cache, grads)
    _, lse = F.causal_softmax(q @ k.transpose(0, 2, 1), 1.0 / np.sqrt(hs))
    return (y4[:, 0], lse[..., 0], *(g[:, 0] for g in grads))


# TF32 operands (11 significant bits) put the float32 kernels' outputs within ~1e-3 of float64's
FLASH_F32_RTOL = 2e-3


@pytest.mark.parametrize("dtype, tf32", [(np.float64, False), (np.float32, True), (np.float32, False)])
@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 37, 16), (2, 64, 64), (1, 70, 48), (1, 150, 32)])
def test_flash_attention_kernels_emulated(emulated, dtype, tf32, shape):
    """Forward (y, lse) and the three gradients of the flash kernels against Ops' dense core: T = 1,
    T not a multiple of the tiles (37, 70, 150: several key tiles of each kernel, the last one partial),
    a multiple of every tile (64), head sizes 16, 32, 48, 64 (float64's at most 32), several heads;
    float32 on TF32 tensor cores (TF32's tolerance) and by FMAs (float32's)."""
    if not attention.flash_fits(shape[-1], dtype):
        shape = (*shape[:2], 32)  # float64 takes heads up to 32
    rng = np.random.default_rng(11)
    q, k, v, dy = (normal(rng, shape, dtype) for _ in range(4))
    scale = 1.0 / np.sqrt(shape[-1])
    y, lse = attention.flash_attention_forward_gpu(q, k, v, scale, tf32=tf32)
    grads = attention.flash_attention_backward_gpu(q, k, v, y, dy, lse, scale, tf32=tf32)
    rtol = FLASH_F32_RTOL if tf32 else None
    for name, got, want in zip(("y", "lse", "dq", "dk", "dv"), (y, lse, *grads), attention_reference(q, k, v, dy)):
        assert got.dtype == dtype, name
        assert_close(got, want, rtol=rtol, scale=1.0)


def test_flash_attention_float32_rounds_its_products_to_tf32(emulated):
    """The float32 kernels' error is TF32's, not float32's: the emulation rounds the operands as
    cvt.rna.tf32 does (a kernel that skipped it would be float32-exact and this would fail)."""
    rng = np.random.default_rng(12)
    q, k, v = (normal(rng, (1, 32, 16), np.float32) for _ in range(3))
    y, _ = attention.flash_attention_forward_gpu(q, k, v, 0.25)
    err = float(np.max(np.abs(y - attention_reference(q, k, v, q)[0])))
    assert 1e-5 < err < 2e-3


def test_the_emulated_mma_follows_the_ptx_fragment_layout(emulated):
    """The emulation's mma.m16n8k8 (minitensor.checks.kernelcheck) against tf32(A) tf32(B) + C, each lane
    loading its fragments from memory in the PTX ISA's layout: a wrong element in the layout or the
    exchange would land in the wrong place of D."""
    spec = cuda.RawSpec("mma_layout", inline=r"""
extern "C" __global__ void mma_layout(const T *a, const T *b, T *c) {
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  const unsigned fa[4] = {to_tf32(a[g * 8 + t]), to_tf32(a[(g + 8) * 8 + t]), to_tf32(a[g * 8 + t + 4]),
                          to_tf32(a[(g + 8) * 8 + t + 4])};
  const unsigned fb[2] = {to_tf32(b[t * 8 + g]), to_tf32(b[(t + 4) * 8 + g])};
  float d[4] = {c[g * 8 + 2 * t], c[g * 8 + 2 * t + 1], c[(g + 8) * 8 + 2 * t], c[(g + 8) * 8 + 2 * t + 1]};
  mma_tf32(d, fa, fb);
  __syncthreads();
  c[g * 8 + 2 * t] = d[0];
  c[g * 8 + 2 * t + 1] = d[1];
  c[(g + 8) * 8 + 2 * t] = d[2];
  c[(g + 8) * 8 + 2 * t + 1] = d[3];
}
""")
    rng = np.random.default_rng(13)
    a, b, c = (normal(rng, shape, np.float32) for shape in ((16, 8), (8, 8), (16, 8)))
    got = c.copy()
    kernelcheck.emulate_launch(spec, np.float32, (1,), (32,), (a, b, got))

    def tf32(x):  # round to nearest, ties away from zero, to 10 mantissa bits
        bits = x.astype(np.float32).view(np.uint32)
        return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)

    want = tf32(a) @ tf32(b) + f64(c)
    assert_close(got, want)
    assert not np.allclose(tf32(a), a, rtol=1e-6, atol=0)  # the rounding is visible at this size


def test_flash_attention_wrappers_refuse_what_the_kernels_do_not_take():
    q = np.zeros((2, 8, 16), np.float32)
    for bad, match in (((2, 8, 24), "head size 24"), ((2, 8, 80), "head size 80")):
        x = np.zeros(bad, np.float32)
        with pytest.raises(ValueError, match=match):
            attention.flash_attention_forward_gpu(x, x, x, 1.0)
    with pytest.raises(ValueError, match="k must be"):
        attention.flash_attention_forward_gpu(q, q.astype(np.float64), q, 1.0)
    with pytest.raises(ValueError, match="y must be"):
        attention.flash_attention_forward_gpu(q, q, q, 1.0, y=np.zeros((2, 8, 16), np.float32), n_head=3)
    assert attention.flash_fits(64, np.float32) and attention.flash_fits(16, np.float64)
    assert not attention.flash_fits(64, np.float16) and not attention.flash_fits(8, np.float32)


def test_launch_checks_the_c_types_of_its_arguments():
    x = np.zeros((2, 4), np.float32)
    w = np.ones(4, np.float32)
    mean = rstd = np.zeros((2, 1), np.float32)
    good = (x, x, w, w, w, x, mean, rstd, np.int32(4), np.float32(1e-5), np.int32(0), np.int32(0))
    cuda.check_launch_args(layernorm.LAYERNORM_FWD, np.float32, good)
    with pytest.raises(TypeError, match="argument C must be a NumPy scalar of int32"):
        cuda.check_launch_args(layernorm.LAYERNORM_FWD, np.float32, good[:8] + (4,) + good[9:])
    with pytest.raises(TypeError, match="argument eps must be a NumPy scalar of float32"):
        cuda.check_launch_args(layernorm.LAYERNORM_FWD, np.float32, good[:9] + (1e-5,) + good[10:])
    with pytest.raises(TypeError, match="argument w must be a contiguous array of float32"):
        cuda.check_launch_args(layernorm.LAYERNORM_FWD, np.float32, good[:3] + (w.astype(np.float64),) + good[4:])
    with pytest.raises(TypeError, match="takes 12 arguments"):
        cuda.check_launch_args(layernorm.LAYERNORM_FWD, np.float32, good[:-1])
    with pytest.raises(TypeError, match="runs on CuPy arrays"):
        cuda.launch(layernorm.LAYERNORM_FWD, np.float32, (2,), (32,), good)


def test_raw_kernel_parameters_are_parsed_from_the_code():
    assert cuda.raw_params(softmax_xent.SOFTMAX_XENT_FWD) == [
        ("z", "T", True), ("targets", "long long", True), ("losses", "ACC", True), ("V", "int", False),
        ("n_valid", "int", False)]


def test_wrappers_refuse_bad_operands():
    x = np.zeros((4, 6), np.float32)
    w = np.ones(6, np.float32)
    with pytest.raises(ValueError, match="contiguous"):
        layernorm.layernorm_forward_gpu(np.zeros((6, 4), np.float32).T, w, w)
    with pytest.raises(ValueError, match="w must be"):
        layernorm.layernorm_forward_gpu(x, np.ones(5, np.float32), w)
    with pytest.raises(ValueError, match="residual must be"):
        layernorm.layernorm_forward_gpu(x, w, w, residual=np.zeros((4, 6)))
    with pytest.raises(ValueError, match=r"\(\.\.\., T, T\)"):
        causal_softmax.causal_softmax_forward_gpu(x)
    with pytest.raises(ValueError, match="lse must hold 8"):
        causal_softmax.causal_softmax_forward_gpu(np.zeros((2, 4, 4)), lse=np.zeros(4))
    with pytest.raises(ValueError, match="targets must be integers"):
        softmax_xent.softmax_xent_forward_gpu(x, np.zeros(4))
    with pytest.raises(ValueError, match="b must be"):
        gelu.bias_gelu_forward_gpu(x, np.ones(4, np.float32))
    hyper = dict(lr=1, beta1=0.9, beta2=0.9, eps=1e-8, weight_decay=0)
    with pytest.raises(ValueError, match="t counts steps from 1"):
        adamw.adamw_step_gpu(x, x, x, x, x, t=0, **hyper)
    with pytest.raises(ValueError, match="g must be"):
        adamw.adamw_step_gpu(x, x[:2], x, x, x, t=1, **hyper)
    with pytest.raises(TypeError, match="runs on CuPy arrays; on NumPy use Ops.adamw_step"):
        adamw.adamw_step_gpu(x, x, x, x, x, t=1, **hyper)
    with pytest.raises(TypeError, match="on NumPy use Ops.bias_gelu_forward"):
        gelu.bias_gelu_forward_gpu(x, w)


def test_emulation_refuses_partly_overlapping_buffers():
    if shutil.which("g++") is None:
        pytest.skip("no g++")
    flat = np.zeros(17)
    dp, p, ds = flat[1:].reshape(1, 4, 4), np.zeros((1, 4, 4)), flat[:16].reshape(1, 4, 4)
    with pytest.raises(ValueError, match="partly overlaps"):
        kernelcheck.emulate_launch(causal_softmax.CAUSAL_SOFTMAX_BWD, np.float64, (4,), (32,),
                               (dp, p, ds, np.int32(4), np.float64(1)))


# --- On a GPU: every wrapper against its formula -------------------------------------------------


gpu_settings = settings(max_examples=15)
dtypes = st.sampled_from(DTYPES)


@pytest.mark.gpu
@gpu_settings
@given(shape=st.tuples(st.integers(1, 5), st.integers(1, 3), st.integers(1, 700)), dtype=dtypes, seed=S.seeds)
def test_gpu_bias_gelu(cupy, shape, dtype, seed):
    rng = np.random.default_rng(seed)
    x, dy, b = normal(rng, shape, dtype, 3.0), normal(rng, shape, dtype), normal(rng, shape[-1], dtype)
    xg, bg, dyg = cupy.asarray(x), cupy.asarray(b), cupy.asarray(dy)
    assert_close(cupy.asnumpy(gelu.bias_gelu_forward_gpu(xg, bg)), F.gelu(f64(x) + f64(b)))
    db = cupy.zeros(shape[-1], dtype)
    dh = gelu.bias_gelu_backward_gpu(xg, bg, dyg, db=db)
    dh_ref = F.gelu_backward(f64(x) + f64(b), f64(dy))
    assert_close(cupy.asnumpy(dh), dh_ref, scale=float(np.max(np.abs(dy))))
    assert_close(cupy.asnumpy(db), dh_ref.reshape(-1, shape[-1]).sum(0), scale=float(np.max(np.abs(dy))))
    strided = gelu.bias_gelu_forward_gpu(xg[:, ::2], bg)  # another generated kernel: not reduced to 1-D
    assert_close(cupy.asnumpy(strided), F.gelu(f64(x[:, ::2]) + f64(b)))


@pytest.mark.gpu
@gpu_settings
@given(N=st.integers(1, 300), C=st.integers(1, 800), dtype=dtypes, residual=st.booleans(), seed=S.seeds)
def test_gpu_layernorm(cupy, N, C, dtype, residual, seed):
    rng = np.random.default_rng(seed)
    x, dy, r = (normal(rng, (N, C), dtype, 2.0, 0.5) for _ in range(3))
    w, b = normal(rng, C, dtype, 0.5, 1.0), normal(rng, C, dtype)
    xg = cupy.asarray(x)
    y, mean, rstd = layernorm.layernorm_forward_gpu(xg, cupy.asarray(w), cupy.asarray(b), 1e-5,
                                                  residual=cupy.asarray(r) if residual else None)
    x_in = f64(x) + f64(r) if residual else f64(x)
    y_ref, mean_ref, rstd_ref = F.layernorm_forward(x_in, f64(w), f64(b))
    assert_close(cupy.asnumpy(xg), x_in, scale=1.0)
    assert_close(cupy.asnumpy(y), y_ref)
    assert_close(cupy.asnumpy(mean), mean_ref, scale=1.0)
    assert_close(cupy.asnumpy(rstd), rstd_ref)
    dw, db = cupy.zeros(C, dtype), cupy.zeros(C, dtype)
    add_to = cupy.asarray(r) if residual else None
    dx = layernorm.layernorm_backward_gpu(cupy.asarray(dy), xg, cupy.asarray(w), mean, rstd, dw, db, add_to=add_to)
    dx_ref, dw_ref, db_ref = F.layernorm_backward(f64(dy), x_in, f64(w), mean_ref, rstd_ref)
    scale = float(np.max(np.abs(f64(dy) * f64(w) * rstd_ref)))
    assert_close(cupy.asnumpy(dx), dx_ref + (f64(r) if residual else 0.0), scale=scale)
    assert_close(cupy.asnumpy(dw), dw_ref, scale=float(np.max(np.abs(dy))))
    assert_close(cupy.asnumpy(db), db_ref, scale=float(np.max(np.abs(dy))))


@pytest.mark.gpu
@gpu_settings
@given(BH=st.integers(1, 4), T=st.integers(1, 300), dtype=dtypes, scale=st.sampled_from([1.0, 0.125]),
       seed=S.seeds)
def test_gpu_causal_softmax(cupy, BH, T, dtype, scale, seed):
    rng = np.random.default_rng(seed)
    s, dp = normal(rng, (BH, T, T), dtype, 3.0), normal(rng, (BH, T, T), dtype)
    lse = cupy.empty((BH, T, 1), dtype)
    sg = cupy.asarray(s)
    p = causal_softmax.causal_softmax_forward_gpu(sg, scale, lse=lse)
    p_ref, lse_ref = F.causal_softmax(f64(s), scale)
    assert_close(cupy.asnumpy(p), p_ref)
    assert_close(cupy.asnumpy(lse), lse_ref, scale=1.0)
    again = causal_softmax.causal_softmax_recompute_gpu(sg.copy(), lse, scale)
    assert_close(cupy.asnumpy(again), p_ref)
    ds = causal_softmax.causal_softmax_backward_gpu(cupy.asarray(dp), p, scale)
    assert_close(cupy.asnumpy(ds), F.causal_softmax_backward(f64(dp), p_ref, scale),
                 scale=scale * float(np.max(np.abs(dp))))
    assert causal_softmax.causal_softmax_forward_gpu(sg, scale, out=sg) is sg  # in place
    assert_close(cupy.asnumpy(sg), p_ref)


@pytest.mark.gpu
@settings(deadline=None, max_examples=8)
@given(BH=st.integers(1, 3), T=st.integers(1, 130), hs=st.sampled_from([16, 32, 48, 64]), dtype=dtypes,
       seed=S.seeds)
def test_gpu_flash_attention(cupy, BH, T, hs, dtype, seed):
    assume(attention.flash_fits(hs, dtype))  # heads of 48 and 64 are float32's only
    rng = np.random.default_rng(seed)
    q, k, v, dy = (normal(rng, (BH, T, hs), dtype) for _ in range(4))
    scale = 1.0 / np.sqrt(hs)
    qg, kg, vg = (cupy.asarray(a) for a in (q, k, v))
    y, lse = attention.flash_attention_forward_gpu(qg, kg, vg, scale)
    grads = attention.flash_attention_backward_gpu(qg, kg, vg, y, cupy.asarray(dy), lse, scale)
    rtol = None if dtype == np.float64 else FLASH_F32_RTOL
    for got, want in zip((y, lse, *grads), attention_reference(q, k, v, dy)):
        assert_close(cupy.asnumpy(got), want, rtol=rtol, scale=1.0)


@pytest.mark.gpu
@gpu_settings
@given(N=st.integers(1, 40), V=st.integers(2, 9000), dtype=dtypes, dloss=st.sampled_from([1.0, 0.5]),
       seed=S.seeds)
def test_gpu_cross_entropy(cupy, N, V, dtype, dloss, seed):
    rng = np.random.default_rng(seed)
    logits, targets = normal(rng, (N, V), dtype, 4.0, 3.0), rng.integers(0, V, N)
    z = cupy.asarray(logits)
    loss, losses = softmax_xent.softmax_xent_forward_gpu(z, cupy.asarray(targets))
    loss_ref, probs_ref, losses_ref = F.softmax_xent_forward(f64(logits), targets)
    assert loss.shape == () and isinstance(loss, cupy.ndarray)  # stays on the device
    assert_close(cupy.asnumpy(losses), losses_ref, scale=1.0)
    assert_close(cupy.asnumpy(loss), loss_ref, scale=1.0)
    assert_close(cupy.asnumpy(z), probs_ref)
    d = softmax_xent.softmax_xent_backward_gpu(z, cupy.asarray(targets), dloss)
    assert d is z
    assert_close(cupy.asnumpy(d), F.softmax_xent_backward(probs_ref, targets, dloss), scale=dloss / N)


@pytest.mark.gpu
@gpu_settings
@given(n=st.integers(1, 5000), dtype=dtypes, t=st.integers(1, 50), grad_scale=st.sampled_from([1.0, 0.25]),
       seed=S.seeds)
def test_gpu_adamw(cupy, n, dtype, t, grad_scale, seed):
    rng = np.random.default_rng(seed)
    p, g, m = (normal(rng, n, dtype) for _ in range(3))
    v, mask = np.abs(normal(rng, n, dtype)), (rng.random(n) > 0.3).astype(dtype)
    pg, gg, mg, vg = (cupy.asarray(a) for a in (p, g, m, v))
    hyper = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, t=t, grad_scale=grad_scale)
    assert adamw.adamw_step_gpu(pg, gg, mg, vg, cupy.asarray(mask), **hyper) is pg
    for got, want in zip((pg, mg, vg), F.adamw(f64(p), f64(g), f64(m), f64(v), f64(mask), **hyper)):
        assert_close(cupy.asnumpy(got), want)


@pytest.mark.gpu
@pytest.mark.real_gpu("compares with the code the real CuPy generates at a launch (its cached_codes)")
@pytest.mark.parametrize("name", ELEMENTWISE)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gpu_registered_source_is_what_cupy_compiles(cupy, name, dtype):
    spec = all_kernels()[name]
    fresh = cupy.ElementwiseKernel(spec.in_params, spec.out_params, spec.operation, spec.name)
    scalars = dict(spec.scalars)
    args = []
    for raw, t, pname in kernelcheck._parse_params(spec.in_params):
        if pname in scalars:
            args.append(scalars[pname])
        elif t == "int64":
            args.append(cupy.zeros(1000, np.int64))  # raw: indexed by row, at most 1000 / 5
        else:
            args.append(cupy.ones(1000 if raw else (10, 100), dtype))
    fresh(*args)  # contiguous: reduced to 1-D, 32-bit indexing
    [compiled] = fresh.cached_codes.values()
    assert spec.source(dtype).endswith(compiled)


@needs_cxx
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_epilogue_adds_bias_and_residual_in_one_kernel_as_ops_does(dtype):
    """CupyOps.add_epilogue on the CuPy stand-in: y + b + r in one 'bias_residual_add', to the bit
    Ops' two adds; a residual that is y itself, or no residual, goes through Ops' code."""
    from gpu_standin import standin_cupy

    rng = np.random.default_rng(8)
    y, b, r = (rng.standard_normal(s).astype(dtype) for s in ((9, 70), (70,), (9, 70)))
    want = y.copy()
    Ops(np).add_epilogue(want, b, r)
    with standin_cupy() as cupy:
        ops = cupy_ops.CupyOps(cupy)
        yg = cupy.asarray(y)
        ops.add_epilogue(yg, cupy.asarray(b), cupy.asarray(r))
        assert [name for _, name, _ in cupy.standin.kernels] == ["bias_residual_add"]
        assert np.array_equal(cupy.asnumpy(yg), want)
        ops.add_epilogue(yg, cupy.asarray(b), yg)
        ops.add_epilogue(yg, cupy.asarray(b))
        assert [name for _, name, _ in cupy.standin.kernels] == ["bias_residual_add"]
        got = cupy.asnumpy(yg)
    Ops(np).add_epilogue(want, b, want)
    Ops(np).add_epilogue(want, b)
    assert np.array_equal(got, want)


@needs_cxx
@pytest.mark.parametrize("separate", [False, True])
def test_the_dense_cores_head_split_and_merge_equal_ops(separate):
    """CupyOps' dense core (fused softmax) on the CuPy stand-in, float64, against Ops': with q, k, v
    views of one (B*T, 3C) array (split in one pass, dk and dv merged in one copy) and as separate
    arrays (one pass each)."""
    import types

    from gpu_standin import standin_cupy

    from minitensor.layers.attention import CausalSelfAttention

    B, T, nh, hs = 2, 5, 2, 3
    C = nh * hs
    rng = np.random.default_rng(9)
    qkv, b, dy = rng.standard_normal((B * T, 3 * C)), rng.standard_normal(3 * C), rng.standard_normal((B * T, C))
    layer = types.SimpleNamespace(n_head=nh)

    def run(ops, xp):
        views = CausalSelfAttention._heads(layer, xp.asarray(qkv), B, T)
        dqkv = xp.zeros((B * T, 3 * C))
        grads = CausalSelfAttention._heads(layer, dqkv, B, T)
        if separate:
            views, grads = [v.copy() for v in views], [xp.zeros(g.shape) for g in grads]
        if xp is not np:
            assert (attention.stacked_heads(views) is None) == separate
        y = xp.empty((B, T, C))
        cache = ops.attention_forward(views, xp.asarray(b), CausalSelfAttention._heads(layer, y, B, T, 1)[0],
                                      dense=True)
        ops.attention_backward(CausalSelfAttention._heads(layer, xp.asarray(dy), B, T, 1)[0], cache, grads)
        return [np.asarray(getattr(xp, "asnumpy", np.asarray)(a)) for a in (y, *grads)]

    want = run(Ops(np), np)
    with standin_cupy() as cupy:
        got = run(cupy_ops.CupyOps(cupy, fused=("causal_softmax",)), cupy)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


@needs_cxx
@pytest.mark.parametrize("separate", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_flash_core_equals_ops(separate, dtype):
    """CupyOps' flash core on the CuPy stand-in against Ops' core, with c_attn's bias, through the layer's
    views: q, k, v read where c_attn wrote them (the bias added as the kernels read them), y and dy read and
    written in the (B, T, C) arrays, dq, dk, dv written into the (B, T, 3C) gradient; and with separate
    arrays (copies instead). Two heads of 16, T = 35 (two float32 tiles, three float64 ones, the last partial);
    the flash kernels are what ran."""
    import types

    from gpu_standin import standin_cupy

    from minitensor.layers.attention import CausalSelfAttention

    B, T, nh, hs = 2, 35, 2, 16
    C = nh * hs
    rng = np.random.default_rng(14)
    qkv, b, dy = (normal(rng, shape, dtype) for shape in ((B * T, 3 * C), (3 * C,), (B * T, C)))
    layer = types.SimpleNamespace(n_head=nh)

    def run(ops, xp):
        views = CausalSelfAttention._heads(layer, xp.asarray(qkv), B, T)
        dqkv = xp.zeros((B * T, 3 * C), dtype)
        grads = CausalSelfAttention._heads(layer, dqkv, B, T)
        y = xp.empty((B, T, C), dtype)
        y4 = CausalSelfAttention._heads(layer, y, B, T, 1)[0]
        dy4 = CausalSelfAttention._heads(layer, xp.asarray(dy), B, T, 1)[0]
        if separate:
            views, grads = [v.copy() for v in views], [xp.zeros(g.shape, dtype) for g in grads]
            y4, dy4 = xp.empty(y4.shape, dtype), dy4.copy()
        if xp is not np:
            assert (attention.packed_heads(views) is None) == separate
        cache = ops.attention_forward(views, xp.asarray(b), y4)
        ops.attention_backward(dy4, cache, grads)
        return [np.asarray(getattr(xp, "asnumpy", np.asarray)(a)) for a in (y4, *grads)]

    want = run(Ops(np), np)
    with standin_cupy() as cupy:
        ops = cupy_ops.CupyOps(cupy, fused=("flash_attention",))
        ops.flash_tf32 = dtype == np.float32  # the tensor-core path where it applies
        got = run(ops, cupy)
        launched = [name for _, name, _ in cupy.standin.kernels]
    assert {"flash_attention_fwd", "flash_attention_bwd_dq", "flash_attention_bwd_dkv"} <= set(launched)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, rtol=None if dtype == np.float64 else FLASH_F32_RTOL, scale=1.0)


def test_the_flash_cores_tensor_cores_follow_the_cublas_math_mode():
    """train.tf32 (minitensor.device.set_tf32) reaches the flash kernels as it reaches the batched
    GEMMs, through the cuBLAS handle's math mode; flash_tf32 overrides it (the self-check runs both)."""
    from gpu_standin import standin_cupy

    from minitensor.device import set_tf32

    with standin_cupy() as cupy:
        ops = cupy_ops.CupyOps(cupy, fused=("flash_attention",))
        set_tf32(cupy, True)
        on = attention.tensor_cores(ops)
        set_tf32(cupy, False)
        off = attention.tensor_cores(ops)
        ops.flash_tf32 = True
        forced = attention.tensor_cores(ops)
    assert (on, off, forced) == (True, False, True)


def test_a_math_mode_reset_by_another_call_is_set_back_before_a_gemm_relies_on_it():
    """CuPy's float16 and bfloat16 matmuls set the handle's math mode to the default: the next GEMM
    through minitensor.backends.cublas and the flash kernels' TF32 choice still run as set_tf32 chose."""
    from gpu_standin import standin_cupy

    from minitensor.backends import cublas as project_cublas
    from minitensor.device import CUBLAS_DEFAULT_MATH, CUBLAS_TF32_TENSOR_OP_MATH, set_tf32

    with standin_cupy() as cupy:
        from cupy_backends.cuda.libs import cublas

        handle = cupy.cuda.device.get_cublas_handle()
        ops = cupy_ops.CupyOps(cupy, fused=("flash_attention",))
        set_tf32(cupy, True)
        cublas.setMathMode(handle, CUBLAS_DEFAULT_MATH)  # what a float16 matmul leaves behind
        assert attention.tensor_cores(ops)
        cublas.setMathMode(handle, CUBLAS_DEFAULT_MATH)
        a = cupy.asarray(np.ones((4, 3), np.float32))
        assert project_cublas.gemm(a, a.T, cupy.empty((4, 4), np.float32))
        assert cublas.getMathMode(handle) == CUBLAS_TF32_TENSOR_OP_MATH
        set_tf32(cupy, False)  # off stays off
        assert not attention.tensor_cores(ops) and cublas.getMathMode(handle) == CUBLAS_DEFAULT_MATH


@needs_cxx
@pytest.mark.parametrize("adjacent", [True, False])
def test_weight_and_bias_gradients_written_then_accumulated_equal_ops(adjacent):
    """CupyOps.linear_weight_grads (cuBLAS with beta 0 the first time after fill_zero, GradWrites,
    then 1) and the LayerNorm parameter sums (layernorm_bwd's partials, added by layernorm_bwd_params)
    on the CuPy stand-in, float64, written (just zeroed) then accumulated, against Ops': with db right
    after dW in one buffer (as Params lays them out) and apart."""
    from gpu_standin import standin_cupy

    rng = np.random.default_rng(10)
    N, n_in, n_out = 7, 5, 3
    x, dy = rng.standard_normal((N, n_in)), rng.standard_normal((N, n_out))
    ln_x, ln_dy = rng.standard_normal((N, n_out)), rng.standard_normal((N, n_out))
    gap = 0 if adjacent else 2

    def run(ops, xp):
        g = xp.zeros(n_in * n_out + gap + n_out)
        dW, db = g[:n_in * n_out].reshape(n_in, n_out), g[n_in * n_out + gap:]
        lg = xp.zeros(2 * n_out + gap)
        dw, dbl = lg[:n_out], lg[n_out + gap:]
        ops.fill_zero(g)
        for _ in range(2):
            ops.linear_weight_grads(xp.asarray(x), xp.asarray(dy), dW, db)
        ln = LayerNorm(xp.asarray(rng_w), dw, xp.asarray(rng_b), dbl, ops=ops)
        for _ in range(2):
            ln.forward(xp.asarray(ln_x))
            ln.backward(xp.asarray(ln_dy))
        return [np.asarray(getattr(xp, "asnumpy", np.asarray)(a)) for a in (dW, db, dw, dbl)]

    rng_w, rng_b = rng.standard_normal(n_out), rng.standard_normal(n_out)
    want = run(Ops(np), np)
    with standin_cupy() as cupy:
        got = run(cupy_ops.CupyOps(cupy, fused=("layernorm",)), cupy)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
