"""Each non-GEMM component of a training step against PyTorch's own kernel for the same maths.

    python -m andrea.bench --components            # the table, at ANDREA-120M shapes

Forward + backward at the shapes of ANDREA-120M (1 x 1024 tokens, d 768, 12 heads, V 8449, MLP
3072, 92.3M parameters), float32, all in one process with PyTorch on the same thread count:

    GELU            andrea GELU layer                  F.gelu(approximate="tanh")
    LayerNorm       andrea LayerNorm                   nn.LayerNorm
    attention core  ops.attention_forward/_backward    scaled_dot_product_attention(is_causal=True),
                    (qkv in, y out: no projections)     with the same head split and merge
    cross-entropy   SoftmaxCrossEntropy (in place,     F.cross_entropy
                    as the model runs it)
    AdamW           minitensor AdamW, one step          torch.optim.AdamW(fused=True), one step
    embedding       Embedding forward + backward        F.embedding forward + backward

The engines run interleaved (andrea, andrea on NumPy only, PyTorch, andrea, ...) so that load
on a shared machine hits them alike, each timed run right after an untimed one of the same
engine (so no engine's spinning threads steal the next one's cores), and the best of `repeats`
runs of each is reported. The
"numpy" column is andrea's NumPy backend without the numba kernels (what ANDREA_CPU_KERNELS=numpy
selects).
"""

import time

import numpy as np

from andrea.config import load_config
from andrea.model.sizes import param_shapes
from minitensor.backends import get_ops
from minitensor.flat import Params
from minitensor.layers.embedding import Embedding
from minitensor.layers.gelu import GELU
from minitensor.layers.layernorm import LayerNorm
from minitensor.layers.loss import SoftmaxCrossEntropy
from minitensor.optim import AdamW
from minitensor.parallel import num_threads

ENGINES = ("andrea", "numpy", "torch")
# Each timed run follows an untimed run of the same engine. PyTorch's OpenMP threads (and
# OpenBLAS's) spin for a while after their work, on the cores the next engine needs, and a pause
# instead lets the idle cores slow down (both measured: BENCHMARKS.md, "Components").


def _nothing():
    pass


def _grad_of(out_fn, inputs, dy):
    """PyTorch: forward, then backward from dy, gradients reset first (as zero_grad(set_to_none) does)."""
    def run():
        for t in inputs:
            t.grad = None
        out_fn().backward(dy)
    return run


class _Setup:
    """What every component's case shares: ANDREA-120M's shapes, one random generator (each case
    draws its inputs from it in turn, in the order of CASES), PyTorch, and andrea's two backends:
    "andrea" the numba kernels (the default), "numpy" the NumPy backend without them."""

    def __init__(self, torch, B, T, seed):
        import torch.nn.functional as F

        self.torch, self.F = torch, F
        self.cfg = load_config("120m").model
        self.B, self.T, self.N = B, T, B * T
        self.C, self.nh, self.V, self.H = self.cfg.d_model, self.cfg.n_head, self.cfg.vocab_size, 4 * self.cfg.d_model
        self.rng = np.random.default_rng(seed)
        self.backends = {"andrea": get_ops(kernels="numba"), "numpy": get_ops(kernels="numpy")}

    def randn(self, *shape):
        return self.rng.standard_normal(shape, dtype=np.float32)

    def leaf(self, a):
        """A PyTorch copy of `a` that takes gradients."""
        return self.torch.from_numpy(a.copy()).requires_grad_()

    def engines(self, make, torch_run):
        """{engine: (prepare, run)}: make(ops) -> (prepare, run) for each andrea backend, then PyTorch's
        run (nothing to prepare)."""
        return {**{engine: make(ops) for engine, ops in self.backends.items()}, "torch": (_nothing, torch_run)}


def _gelu(s):
    """GELU over the MLP's hidden activations (N, 4C)."""
    h, dh = s.randn(s.N, s.H), s.randn(s.N, s.H)
    ht = s.leaf(h)

    def andrea(ops):
        gelu = GELU(ops=ops)
        return _nothing, lambda: (gelu.forward(h), gelu.backward(dh))

    torch_run = _grad_of(lambda: s.F.gelu(ht, approximate="tanh"), [ht], s.torch.from_numpy(dh))
    return f"{s.N} x {s.H}", s.engines(andrea, torch_run)


def _layernorm(s):
    """LayerNorm over the residual stream (N, C)."""
    C = s.C
    r, dr = s.randn(s.N, C), s.randn(s.N, C)
    w, b = 1 + 0.1 * s.randn(C), 0.1 * s.randn(C)
    tln = s.torch.nn.LayerNorm(C)
    rt = s.leaf(r)

    def andrea(ops):
        ln = LayerNorm(w, np.zeros(C, np.float32), b, np.zeros(C, np.float32), ops=ops)
        return _nothing, lambda: (ln.forward(r), ln.backward(dr))

    torch_run = _grad_of(lambda: tln(rt), [rt, *tln.parameters()], s.torch.from_numpy(dr))
    return f"{s.N} x {C}", s.engines(andrea, torch_run)


def _attention(s):
    """The attention core: qkv (B, T, 3C) -> y (B, T, C), the backend's core between the two projections."""
    B, T, C, nh = s.B, s.T, s.C, s.nh
    qkv, dyy = s.randn(B, T, 3 * C), s.randn(B, T, C)
    qkvt = s.leaf(qkv)

    def heads(a, parts):
        a = a.reshape(B, T, parts, nh, C // nh)
        return [a[:, :, i].transpose(0, 2, 1, 3) for i in range(parts)]

    def andrea(ops):
        def run():
            y = np.empty((B, T, C), np.float32)
            cache = ops.attention_forward(heads(qkv, 3), None, heads(y, 1)[0])
            dqkv = np.empty((B, T, 3 * C), np.float32)
            ops.attention_backward(heads(dyy, 1)[0], cache, heads(dqkv, 3))
        return _nothing, run

    def torch_attention():
        q, k, v = (t.view(B, T, nh, C // nh).transpose(1, 2) for t in qkvt.split(C, dim=2))
        y = s.F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(B, T, C)

    return f"{B} x {T}, {nh} heads", s.engines(andrea, _grad_of(torch_attention, [qkvt], s.torch.from_numpy(dyy)))


def _cross_entropy(s):
    """Softmax cross-entropy over the tied head's logits (N, V); andrea overwrites them, so each run
    starts from a fresh copy (untimed)."""
    logits, targets = s.randn(s.N, s.V), s.rng.integers(0, s.V, s.N)
    work = np.empty_like(logits)
    lt, tt = s.leaf(logits), s.torch.from_numpy(targets)

    def andrea(ops):
        ce = SoftmaxCrossEntropy(ops=ops)
        return (lambda: np.copyto(work, logits), lambda: (ce.forward(work, targets, inplace=True), ce.backward()))

    return f"{s.N} x {s.V}", s.engines(andrea, _grad_of(lambda: s.F.cross_entropy(lt, tt), [lt], None))


def _adamw(s):
    """One AdamW step over the 120m parameter layout, decay on 2+-D tensors."""
    shapes = param_shapes(s.cfg)
    data = 0.02 * s.rng.standard_normal(Params(shapes).size, dtype=np.float32)
    grads = 1e-3 * s.rng.standard_normal(data.size, dtype=np.float32)

    def andrea(ops):
        params = Params(shapes, ops=ops)
        params.data[:], params.grads[:] = data, grads
        return _nothing, AdamW(params, lr=6e-4).step

    tparams, offset = {}, Params(shapes).offsets
    for n in shapes:
        size = int(np.prod(shapes[n]))
        tparams[n] = s.leaf(data[offset[n]:offset[n] + size].reshape(shapes[n]))
        tparams[n].grad = s.torch.from_numpy(grads[offset[n]:offset[n] + size].reshape(shapes[n]).copy())
    groups = [{"params": [t for n, t in tparams.items() if len(shapes[n]) >= 2], "weight_decay": 0.1},
              {"params": [t for n, t in tparams.items() if len(shapes[n]) < 2], "weight_decay": 0.0}]
    topt = s.torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    n_params = sum(int(np.prod(shape)) for shape in shapes.values())
    return f"{n_params / 1e6:.1f}M parameters", s.engines(andrea, topt.step)


def _embedding(s):
    """The token embedding (V, C), ids (B, T): forward, and backward into the gradient."""
    W, idx, de = s.randn(s.V, s.C), s.rng.integers(0, s.V, (s.B, s.T)), s.randn(s.B, s.T, s.C)
    Wt, idxt = s.leaf(W), s.torch.from_numpy(idx)

    def andrea(ops):
        emb = Embedding(W, np.zeros_like(W), ops=ops)
        return _nothing, lambda: (emb.forward(idx), emb.backward(de))

    torch_run = _grad_of(lambda: s.F.embedding(idxt, Wt), [Wt], s.torch.from_numpy(de))
    return f"{s.B} x {s.T} ids, {s.V} x {s.C}", s.engines(andrea, torch_run)


# The components in the order they are measured and drawn from the shared random generator.
CASES = {"GELU": _gelu, "LayerNorm": _layernorm, "attention core": _attention, "cross-entropy": _cross_entropy,
         "AdamW": _adamw, "embedding": _embedding}


def _cases(torch, B=1, T=1024, seed=0):
    """name -> (shape text, {engine: (prepare, run)}); prepare() is untimed, run() is timed."""
    setup = _Setup(torch, B, T, seed)
    return {name: case(setup) for name, case in CASES.items()}


def measure(repeats=7, names=None):
    """{component: {"shape": str, engine: [seconds per run, ...]}}, engines interleaved run by run."""
    import torch

    torch.set_num_threads(num_threads())
    cases = _cases(torch)
    out = {}
    for name, (shape, fns) in cases.items():
        if names and name not in names:
            continue
        times = {e: [] for e in ENGINES}
        for r in range(repeats + 1):                         # run 0 is warm-up (and JIT compilation)
            for engine in ENGINES:
                prepare, run = fns[engine]
                prepare()
                run()                                        # untimed, right before: see LEAD_IN
                prepare()
                t = time.perf_counter()
                run()
                if r:
                    times[engine].append(time.perf_counter() - t)
        out[name] = {"shape": shape, **times}
    return out


def print_table(results, fast_path):
    print(f"andrea fast path: {fast_path}; threads: {num_threads()}; best of the runs, forward + backward")
    head = f"{'component':<15} {'shape':<24} {'andrea ms':>10} {'numpy ms':>10} {'torch ms':>10} {'ratio':>7}"
    print(head)
    print("-" * len(head))
    for name, r in results.items():
        a, n, t = (1e3 * min(r[e]) for e in ENGINES)
        print(f"{name:<15} {r['shape']:<24} {a:>10.2f} {n:>10.2f} {t:>10.2f} {a / t:>7.2f}")
    print("ratio = andrea / PyTorch (below 1: andrea faster)")
