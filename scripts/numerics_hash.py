"""Fingerprints of the engine's numerics: sha256 of the losses, gradients and weights of a few
training steps, so that a refactoring can show it changed no arithmetic.

    python scripts/numerics_hash.py                 # every case below, one line each
    python scripts/numerics_hash.py --configs tiny  # a subset

For each model config (tiny, small), CPU kernels setting (numba, numpy: what
ANDREA_CPU_KERNELS selects) and dtype, it builds the model from seed 0, takes STEPS steps of the
training loop's arithmetic on fixed random batches (zero_grad, loss, backward, global norm,
clipping, AdamW with weight decay) and prints the sha256 (first 16 hex digits) of

    loss     the losses of every step, as float64
    grad     the flat gradient buffer after the last backward
    weight   the flat parameter buffer after the last step
    adam     AdamW's m and v after the last step
    kv       the logits of a short key/value-cached decode (the sampling path)

Each case runs in a process of its own with ANDREA_NUM_THREADS fixed (the numba kernels are
bit-reproducible at a fixed thread count, not across counts). Two runs of the same code on the
same machine print the same lines; a change that keeps the arithmetic keeps them.
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys

CASES = [
    ("tiny", "numba", "float32"), ("tiny", "numpy", "float32"),
    ("tiny", "numba", "float64"), ("tiny", "numpy", "float64"),
    ("small", "numba", "float32"), ("small", "numpy", "float32"),
    ("small", "numba", "float64"),
]
STEPS = 3
THREADS = "2"


def sha(*arrays):
    import numpy as np

    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def run_case(config, kernels, dtype):
    """The fingerprints of one case, in this process (ANDREA_CPU_KERNELS already set)."""
    import numpy as np

    from andrea.config import load_config
    from andrea.model.transformer import ANDREA
    from minitensor.device import to_numpy
    from minitensor.optim import AdamW

    cfg = load_config(config)
    model = ANDREA(cfg.model, device="cpu", dtype=dtype, seed=0)
    opt = AdamW(model, lr=1e-3, weight_decay=0.1)
    rng = np.random.default_rng(1)
    B, T = (4, cfg.model.context_length) if config == "tiny" else (2, cfg.model.context_length)
    losses = []
    for _ in range(STEPS):
        x = rng.integers(0, cfg.model.vocab_size, (B, T))
        y = rng.integers(0, cfg.model.vocab_size, (B, T))
        model.zero_grad()
        loss = model.loss(x, y)
        model.backward(0.5)  # a dloss != 1 takes the scaling path of the cross-entropy's backward
        norm = model.ops.global_norm(model.params.grads)
        scale, finite = model.ops.clip_scale(norm, 1.0, loss)
        assert bool(finite)
        opt.step(lr=1e-3, grad_scale=scale)
        losses.append(float(loss))
    grads = to_numpy(model.params.grads)
    cache = model.new_kv_cache(1)
    prompt = rng.integers(0, cfg.model.vocab_size, (1, 5))
    kv = [to_numpy(model.forward_kv(prompt, cache, 0))]
    for pos in range(5, 8):
        kv.append(to_numpy(model.forward_kv(prompt[:, :1], cache, pos)))
    return {
        "loss": sha(np.array(losses, dtype=np.float64)),
        "grad": sha(grads),
        "weight": sha(to_numpy(model.params.data)),
        "adam": sha(*(to_numpy(state) for state in opt.named_state().values())),
        "kv": sha(*kv),
        "losses": [round(v, 6) for v in losses],
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=["tiny", "small"])
    parser.add_argument("--case", nargs=3, help=argparse.SUPPRESS)  # config kernels dtype: one case, here
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(*args.case)))
        return 0
    for config, kernels, dtype in CASES:
        if config not in args.configs:
            continue
        env = dict(os.environ, ANDREA_CPU_KERNELS=kernels, ANDREA_NUM_THREADS=THREADS)
        out = subprocess.run([sys.executable, __file__, "--case", config, kernels, dtype], env=env,
                             capture_output=True, text=True)
        if out.returncode:
            print(f"{config:5} {kernels:5} {dtype}: failed\n{out.stderr}", file=sys.stderr)
            return 1
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{config:5} {kernels:5} {dtype}  loss {r['loss']}  grad {r['grad']}  weight {r['weight']}  "
              f"adam {r['adam']}  kv {r['kv']}  losses {r['losses']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
