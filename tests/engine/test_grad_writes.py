"""Every write into a gradient view after zero_grad adds up, whatever the order of the writers.

A backend may write a gradient's first contribution after fill_zero instead of adding it to zeros
(its GEMMs: minitensor.backends.tricks.GradWrites). That is right only while nothing else has written
into the view since the fill; here each writer runs first and a GEMM into the same bytes after it,
on every backend (NumPy with and without numba; CuPy, its fused pieces off and on, on the GPU or the
stand-in), and the sums must equal the writers' gradients added one by one. The tied head and the
token embedding share `wte`'s gradient: their backward in either order gives the same gradient.
"""

import ast
import inspect
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from layer_cases import CASES

from minitensor.backends import fused_pieces
from minitensor.backends.ops import Ops
from minitensor.backends.tricks import GRAD_VIEWS, GradWrites, grad_writers
from minitensor.device import to_numpy
from minitensor.flat import Params
from minitensor.layers.embedding import Embedding, TiedHead

ROOT = Path(__file__).resolve().parents[2]
DIMS = {"B": 2, "T": 5, "C": 8, "n_head": 2, "n_in": 5, "n_out": 6, "V": 11}
# the cases whose layers write parameter gradients (the bias+activation cases run ops' pieces alone and
# add their parameters' gradients themselves, as a test's textbook: no layer of the engine writes them)
WRITERS = sorted(name for name, build in CASES.items()
                 if (case := build(np, np.float64, 0, DIMS)).layer is not None and case.params.names())


def backends(xp):
    """Each backend for arrays of xp, by name."""
    if xp is np:
        from minitensor.backends.numpy_ops import NumpyOps

        return {"ops": Ops(np), "numpy": NumpyOps(numba=False), "numba": NumpyOps(numba=True)}
    from minitensor.backends.cupy_ops import CupyOps

    return {"ops": Ops(xp), "cupy": CupyOps(xp), "cupy-fused": CupyOps(xp, fused=tuple(fused_pieces()))}


_slices = st.tuples(st.integers(0, 16), st.integers(0, 16), st.sampled_from([1, 1, 2, -1]))


@settings(max_examples=200, deadline=None)
@given(views=st.lists(_slices, min_size=1, max_size=12), refill=st.integers(0, 12))
def test_grad_writes_answers_whether_any_element_of_a_view_was_written(views, refill):
    """GradWrites.first against a mask of the buffer's written elements: yes exactly where no element
    of the view is marked and the view is contiguous, and every element it reaches marked after; views
    that overlap in part, contain one another or touch, strided and reversed, and a fill that clears it."""
    buffer, writes = np.zeros((4, 4)), GradWrites()
    flat, written = buffer.reshape(-1), np.zeros(16, bool)
    assert not writes.first(flat[:5])                        # no fill yet: never yes
    writes.zeroed(buffer)
    for n, (a, b, step) in enumerate(views):
        if n == refill:
            writes.zeroed(buffer)
            written[:] = False
        lo, hi = min(a, b), max(a, b)
        part = slice(lo, hi, step) if step > 0 else slice(hi - 1, lo - 1 if lo else None, -1)
        view, ids = flat[part], np.arange(16)[part]
        reach = np.arange(ids.min(), ids.max() + 1) if ids.size else ids  # the elements between its ends
        want = view.size > 0 and not written[reach].any() and view.flags.c_contiguous
        assert writes.first(view) == want, (n, a, b, step)
        written[reach] = True
    assert not writes.first(np.zeros(3))                     # outside the buffer: never yes


def tied(ops, xp, order, seed=0):
    """wte's gradient after zero_grad and the token embedding's and the tied head's backward in `order`."""
    rng = np.random.default_rng(seed)
    V, C, B, T = 11, 8, 2, 5
    p = Params({"wte": (V, C)}, xp=xp, dtype=np.float64, ops=ops)
    p.data[...] = xp.asarray(rng.standard_normal(p.data.shape))
    layers = {"embedding": Embedding(p["wte"], p.grad("wte"), ops=ops), "head": TiedHead(p["wte"], p.grad("wte"),
                                                                                         ops=ops)}
    idx = xp.asarray(rng.integers(0, V, (B, T)))            # repeated ids: the scatter-add's sums
    x = xp.asarray(rng.standard_normal((B, T, C)))
    dy = {"embedding": xp.asarray(rng.standard_normal((B, T, C))), "head": xp.asarray(rng.standard_normal((B, T, V)))}
    layers["embedding"].forward(idx)
    layers["head"].forward(x)
    p.zero_grad()
    for name in order:
        layers[name].backward(dy[name])
    return to_numpy(p.grad("wte")).copy()


@pytest.mark.parametrize("order", [("head", "embedding"), ("embedding", "head")], ids=["head first", "embedding first"])
def test_the_tied_head_and_the_embedding_add_up_in_either_order(xp, order):
    """The model runs the head's backward first; reordered, the embedding's scatter-add comes first
    and the head's GEMM must add to it, not write over it."""
    want = tied(Ops(np), np, ("head", "embedding"))
    for name, ops in backends(xp).items():
        np.testing.assert_allclose(tied(ops, xp, order), want, rtol=1e-12, atol=1e-12, err_msg=name)


def test_a_writer_left_out_of_the_count_loses_the_gradient_it_wrote():
    """The check above can fail: with the embedding's scatter-add not counted (as under the bookkeeping
    that knew only the GEMMs' own views), the head's GEMM finds wte's gradient unwritten and writes over
    the embedding's rows."""
    from minitensor.backends.numpy_ops import NumpyOps

    want = tied(Ops(np), np, ("head", "embedding"))
    ops = NumpyOps(numba=False)
    ops.scatter_add_rows = inspect.unwrap(ops.scatter_add_rows)
    np.testing.assert_allclose(tied(ops, np, ("head", "embedding")), want, rtol=1e-12, atol=1e-12)
    assert not np.allclose(tied(ops, np, ("embedding", "head")), want, rtol=1e-6, atol=1e-6)


def case_gradients(name, ops, xp, gemm_after=None):
    """(the flat gradient buffer, its Params) after fill_zero and one backward of the layer case `name` on
    ops; with gemm_after (rng), then a GEMM (linear_weight_grads) into the bytes of each gradient view,
    whose product is added into the returned want (the buffer without the GEMMs, plus each product)."""
    case = CASES[name](xp, np.float64, 3, {**DIMS, "ops": ops})
    dy = 1.5 if case.out_shape == () else xp.asarray(np.random.default_rng(4).standard_normal(case.out_shape))
    case.forward()
    ops.fill_zero(case.params.grads)
    case.backward(dy)
    products = {}
    for n in ([] if gemm_after is None else case.params.names()):
        view = case.params.grad(n)
        grid = view.reshape(1, -1) if view.ndim == 1 else view.reshape(-1, view.shape[-1])
        a, b = (xp.asarray(gemm_after.standard_normal((3, k))) for k in grid.shape)
        ops.linear_weight_grads(a, b, grid, None)            # grid += a^T b, a GEMM's gradient
        products[n] = (to_numpy(a).T @ to_numpy(b)).reshape(-1)
    return to_numpy(case.params.grads).copy(), case.params, products


@pytest.mark.parametrize("name", WRITERS)
def test_a_gemm_after_any_writer_adds_to_what_it_wrote(xp, name):
    """Each layer's gradient writes (a GEMM, LayerNorm's sums, the embedding's scatter-add, the
    position embedding's batch sum), then a GEMM into every one of its gradient views: each view ends
    as the layer's gradient plus the GEMM's product, on every backend."""
    for backend, ops in backends(xp).items():
        want, _, _ = case_gradients(name, ops, xp)
        got, params, products = case_gradients(name, ops, xp, gemm_after=np.random.default_rng(5))
        for n, product in products.items():
            want[params.offsets[n]:params.offsets[n] + product.size] += product
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=f"{name} on {backend}")


def test_no_layer_writes_a_gradient_view_itself():
    """A layer hands its gradient views to its backend's writers (tricks.grad_writers), which keep the
    account of the writes: any other use of a view in a layer or the model (`self.dW[...] = ...`,
    `self.dw += ...`, `np.matmul(..., out=self.dW)`, `xp.add.at(self.db, ...)`) would be a writer the
    account misses. Binding a view (`self.dW = dW`) and handing it, or a slice of it, to
    `self.ops.WRITER(...)` are the only uses allowed."""
    writers, found = set(grad_writers()), []
    for path in sorted([*(ROOT / "minitensor" / "layers").glob("*.py"), *(ROOT / "andrea" / "model").glob("*.py")]):
        tree = ast.parse(path.read_text())
        allowed = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):                 # binding: self.dW = dW, or in a tuple
                for target in node.targets:
                    allowed.update(id(t) for t in (target.elts if isinstance(target, ast.Tuple) else [target]))
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in writers
                    and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "ops"):
                for arg in [*node.args, *(k.value for k in node.keywords)]:
                    while isinstance(arg, ast.Subscript):
                        arg = arg.value
                    allowed.add(id(arg))
        found += [f"{path.relative_to(ROOT)}:{node.lineno}" for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and node.attr in GRAD_VIEWS and id(node) not in allowed]
    assert not found, f"gradient views used by a layer other than through its backend's writers: {found}"

