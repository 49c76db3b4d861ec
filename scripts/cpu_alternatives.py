"""GELU and LayerNorm (forward + backward, 120m shapes, float32) three ways: NumPy (the reference
path), numexpr (whole expressions compiled to its virtual machine, multi-threaded) and numba (the
fast path), with PyTorch for scale; interleaved, best of N. Why the fast path is numba:

    python scripts/cpu_alternatives.py [repeats]

numexpr fuses an elementwise expression into one pass but cannot hold a row reduction inside
one (LayerNorm's mean, variance and backward sums stay NumPy passes), and its tanh/exp are its
own (VML when built with MKL).
"""

import math
import os
import sys
import time

import numexpr as ne
import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from minitensor.backends import get_ops  # noqa: E402
from minitensor.layers.gelu import GELU  # noqa: E402
from minitensor.layers.layernorm import LayerNorm  # noqa: E402
from minitensor.parallel import num_threads  # noqa: E402

C_, A_ = math.sqrt(2 / math.pi), 0.044715


def gelu_numexpr(x, dy):
    v = {"x": x, "dy": dy, "c": np.float32(C_), "a": np.float32(A_)}
    y = ne.evaluate("0.5 * x * (1 + tanh(c * (x + a * x * x * x)))", local_dict=v)
    v["t"] = ne.evaluate("tanh(c * (x + a * x * x * x))", local_dict=v)
    dx = ne.evaluate("dy * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * a * x * x))", local_dict=v)
    return y, dx


def gelu_numexpr_sigmoid(x, dy):
    """The sigmoid form the NumPy and numba paths use (numexpr's float32 tanh is slow without VML)."""
    v = {"x": x, "dy": dy, "c": np.float32(C_), "a": np.float32(A_)}
    y = ne.evaluate("x / (1 + exp(-2 * c * (x + a * x * x * x)))", local_dict=v)
    v["s"] = ne.evaluate("1 / (1 + exp(-2 * c * (x + a * x * x * x)))", local_dict=v)
    dx = ne.evaluate("dy * s * (1 + (1 - s) * 2 * c * x * (1 + 3 * a * x * x))", local_dict=v)
    return y, dx


def layernorm_numexpr(x, w, b, dy):
    v = {"x": x, "w": w, "b": b, "dy": dy}

    def ev(expr):
        return ne.evaluate(expr, local_dict=v)

    v["mean"] = x.mean(axis=1, keepdims=True)
    v["xc"] = ev("x - mean")
    v["var"] = ev("xc * xc").mean(axis=1, keepdims=True)
    v["rstd"] = ev("1 / sqrt(var + 1e-5)")
    y = ev("xc * rstd * w + b")
    v["xhat"] = ev("xc * rstd")
    v["g"] = ev("dy * w")
    v["mg"] = v["g"].mean(axis=1, keepdims=True)
    v["mgx"] = ev("g * xhat").mean(axis=1, keepdims=True)
    dx = ev("rstd * (g - mg - xhat * mgx)")
    dw = ev("dy * xhat").sum(axis=0)
    return y, dx, dw, dy.sum(axis=0)


def main(repeats=7):
    torch.set_num_threads(num_threads())
    ne.set_num_threads(num_threads())
    rng = np.random.default_rng(0)
    h, dh = rng.standard_normal((1024, 3072), dtype=np.float32), rng.standard_normal((1024, 3072), dtype=np.float32)
    x, dx = rng.standard_normal((1024, 768), dtype=np.float32), rng.standard_normal((1024, 768), dtype=np.float32)
    w, b = np.ones(768, np.float32), np.zeros(768, np.float32)
    backends = {mode: get_ops(kernels=mode) for mode in ("numpy", "numba")}
    gelu = {mode: GELU(ops=ops) for mode, ops in backends.items()}
    ln = {mode: LayerNorm(w, np.zeros_like(w), b, np.zeros_like(b), ops=ops) for mode, ops in backends.items()}
    ht, xt = torch.from_numpy(h.copy()).requires_grad_(), torch.from_numpy(x.copy()).requires_grad_()
    tln = torch.nn.LayerNorm(768)

    def andrea(mode, layers, *a):
        layer = layers[mode]

        def run():
            layer.forward(a[0])
            layer.backward(a[1])
        return run

    def torch_run(fn, t, d):
        def run():
            t.grad = None
            fn(t).backward(torch.from_numpy(d))
        return run

    cases = {
        "GELU": {"numpy": andrea("numpy", gelu, h, dh), "numexpr": lambda: gelu_numexpr(h, dh),
                 "numexpr-sigmoid": lambda: gelu_numexpr_sigmoid(h, dh),
                 "numba": andrea("numba", gelu, h, dh),
                 "torch": torch_run(lambda t: torch.nn.functional.gelu(t, approximate="tanh"), ht, dh)},
        "LayerNorm": {"numpy": andrea("numpy", ln, x, dx), "numexpr": lambda: layernorm_numexpr(x, w, b, dx),
                      "numba": andrea("numba", ln, x, dx), "torch": torch_run(tln, xt, dx)},
    }
    print(f"threads {num_threads()}, numexpr {ne.__version__} (VML: {ne.use_vml}), best of {repeats}, ms")
    for name, fns in cases.items():
        best = {k: math.inf for k in fns}
        for r in range(repeats + 1):
            for k, fn in fns.items():
                t = time.perf_counter()
                fn()
                if r:
                    best[k] = min(best[k], time.perf_counter() - t)
        print(name, "  ".join(f"{k} {1e3 * v:.2f}" for k, v in best.items()))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7)
