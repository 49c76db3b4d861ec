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
from andrea.model.transformer import param_shapes
from minitensor.backends import get_ops
from minitensor.embedding import Embedding
from minitensor.gelu import GELU
from minitensor.layernorm import LayerNorm
from minitensor.loss import SoftmaxCrossEntropy
from minitensor.optim import AdamW
from minitensor.parallel import num_threads
from minitensor.params import Params

ENGINES = ("andrea", "numpy", "torch")
# Each timed run follows an untimed run of the same engine. PyTorch's OpenMP threads (and
# OpenBLAS's) spin for a while after their work, on the cores the next engine needs (andrea's
# attention core took 44.9 ms right after PyTorch against 40.4 alone), and a pause instead
# lets the idle cores slow down (a 50 ms sleep made both engines' 1 ms LayerNorm ~1.5x slower).


def _cases(torch, B=1, T=1024, seed=0):
    """name -> (shape text, {engine: (prepare, run)}); prepare() is untimed, run() is timed. The
    andrea engines each build their own layers on their backend: "andrea" the numba kernels (the
    default), "numpy" the NumPy backend without them."""
    import torch.nn.functional as F

    cfg = load_config("120m").model
    C, nh, V, H = cfg.d_model, cfg.n_head, cfg.vocab_size, 4 * cfg.d_model
    N = B * T
    rng = np.random.default_rng(seed)
    backends = {"andrea": get_ops(kernels="numba"), "numpy": get_ops(kernels="numpy")}

    def randn(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    def nothing():
        pass

    def grad_of(out_fn, inputs, dy):
        """PyTorch: forward, then backward from dy, gradients reset first (as zero_grad(set_to_none) does)."""
        def run():
            for t in inputs:
                t.grad = None
            out_fn().backward(dy)
        return run

    def each_backend(make):
        """{engine: (prepare, run)} for the andrea engines, make(ops) -> (prepare, run)."""
        return {engine: make(ops) for engine, ops in backends.items()}

    cases = {}

    # GELU (N, 4C)
    h, dh = randn(N, H), randn(N, H)
    ht = torch.from_numpy(h.copy()).requires_grad_()

    def gelu_run(ops):
        gelu = GELU(ops=ops)
        return nothing, lambda: (gelu.forward(h), gelu.backward(dh))

    cases["GELU"] = (f"{N} x {H}", {
        **each_backend(gelu_run),
        "torch": (nothing, grad_of(lambda: F.gelu(ht, approximate="tanh"), [ht], torch.from_numpy(dh))),
    })

    # LayerNorm (N, C)
    r, dr = randn(N, C), randn(N, C)
    w, b = 1 + 0.1 * randn(C), 0.1 * randn(C)
    tln = torch.nn.LayerNorm(C)
    rt = torch.from_numpy(r.copy()).requires_grad_()

    def layernorm_run(ops):
        ln = LayerNorm(w, np.zeros(C, np.float32), b, np.zeros(C, np.float32), ops=ops)
        return nothing, lambda: (ln.forward(r), ln.backward(dr))

    cases["LayerNorm"] = (f"{N} x {C}", {
        **each_backend(layernorm_run),
        "torch": (nothing, grad_of(lambda: tln(rt), [rt, *tln.parameters()], torch.from_numpy(dr))),
    })

    # attention core: qkv (B, T, 3C) -> y (B, T, C), the backend's core between the two projections
    qkv, dyy = randn(B, T, 3 * C), randn(B, T, C)
    qkvt = torch.from_numpy(qkv.copy()).requires_grad_()

    def heads(a, parts):
        a = a.reshape(B, T, parts, nh, C // nh)
        return [a[:, :, i].transpose(0, 2, 1, 3) for i in range(parts)]

    def attention_run(ops):
        def run():
            y = np.empty((B, T, C), np.float32)
            cache = ops.attention_forward(heads(qkv, 3), None, heads(y, 1)[0])
            dqkv = np.empty((B, T, 3 * C), np.float32)
            ops.attention_backward(heads(dyy, 1)[0], cache, heads(dqkv, 3))
        return nothing, run

    def torch_attention():
        q, k, v = (t.view(B, T, nh, C // nh).transpose(1, 2) for t in qkvt.split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(B, T, C)

    cases["attention core"] = (f"{B} x {T}, {nh} heads", {
        **each_backend(attention_run),
        "torch": (nothing, grad_of(torch_attention, [qkvt], torch.from_numpy(dyy))),
    })

    # softmax cross-entropy over the tied head's logits (N, V); andrea overwrites them, so each run
    # starts from a fresh copy (untimed)
    logits, targets = randn(N, V), rng.integers(0, V, N)
    work = np.empty_like(logits)
    lt, tt = torch.from_numpy(logits.copy()).requires_grad_(), torch.from_numpy(targets)

    def xent_run(ops):
        ce = SoftmaxCrossEntropy(ops=ops)
        return (lambda: np.copyto(work, logits), lambda: (ce.forward(work, targets, inplace=True), ce.backward()))

    cases["cross-entropy"] = (f"{N} x {V}", {
        **each_backend(xent_run),
        "torch": (nothing, grad_of(lambda: F.cross_entropy(lt, tt), [lt], None)),
    })

    # AdamW over the 120m parameter layout, decay on 2+-D tensors
    shapes = param_shapes(cfg)
    data = 0.02 * rng.standard_normal(Params(shapes).size, dtype=np.float32)
    grads = 1e-3 * rng.standard_normal(data.size, dtype=np.float32)

    def adamw_run(ops):
        params = Params(shapes, ops=ops)
        params.data[:], params.grads[:] = data, grads
        return nothing, AdamW(params, lr=6e-4).step

    tparams, offset = {}, Params(shapes).offsets
    for n in shapes:
        size = int(np.prod(shapes[n]))
        tparams[n] = torch.from_numpy(data[offset[n]:offset[n] + size].reshape(shapes[n]).copy()).requires_grad_()
        tparams[n].grad = torch.from_numpy(grads[offset[n]:offset[n] + size].reshape(shapes[n]).copy())
    groups = [{"params": [t for n, t in tparams.items() if len(shapes[n]) >= 2], "weight_decay": 0.1},
              {"params": [t for n, t in tparams.items() if len(shapes[n]) < 2], "weight_decay": 0.0}]
    topt = torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    n_params = sum(int(np.prod(s)) for s in shapes.values())
    cases["AdamW"] = (f"{n_params / 1e6:.1f}M parameters", {
        **each_backend(adamw_run),
        "torch": (nothing, topt.step),
    })

    # token embedding (V, C), ids (B, T): forward + backward into the gradient
    W, idx, de = randn(V, C), rng.integers(0, V, (B, T)), randn(B, T, C)
    Wt, idxt = torch.from_numpy(W.copy()).requires_grad_(), torch.from_numpy(idx)

    def embedding_run(ops):
        emb = Embedding(W, np.zeros_like(W), ops=ops)
        return nothing, lambda: (emb.forward(idx), emb.backward(de))

    cases["embedding"] = (f"{B} x {T} ids, {V} x {C}", {
        **each_backend(embedding_run),
        "torch": (nothing, grad_of(lambda: F.embedding(idxt, Wt), [Wt], torch.from_numpy(de))),
    })
    return cases


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
