"""Activation memory kept from forward to backward: the bytes every layer's cache holds after one
forward, each underlying buffer counted once.

    python scripts/activation_memory.py [config] [batch] [seq]    # default: 120m 1 1024

Prints the total in MiB and, per layer and token, in d_model floats (what
andrea/run/preflight.py's ACTIVATION_FLOATS_PER_LAYER estimates), the logits and the head's inputs
taken out first.
"""

import sys

import numpy as np

from andrea.config import load_config
from andrea.model.transformer import ANDREA
from minitensor.layers.layer import Layer


def layers_of(obj, depth=0, found=None):
    """Every Layer reachable from obj through attributes and lists (a few levels deep)."""
    found = {} if found is None else found
    if isinstance(obj, Layer):
        found[id(obj)] = obj
    if depth < 4:
        for value in getattr(obj, "__dict__", {}).values():
            for item in value if isinstance(value, list) else [value]:
                if hasattr(item, "__dict__") and not isinstance(item, np.ndarray):
                    layers_of(item, depth + 1, found)
    return found.values()


def buffers(obj, out):
    """out[id(base)] = nbytes for every array in a cache, by the array that owns its memory."""
    if isinstance(obj, np.ndarray):
        while isinstance(obj.base, np.ndarray):
            obj = obj.base
        out[id(obj)] = obj.nbytes
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            buffers(item, out)


def main(argv):
    name = argv[0] if argv else "120m"
    B, T = (int(argv[1]), int(argv[2])) if len(argv) > 2 else (1, 1024)
    cfg = load_config(name).model
    model = ANDREA(cfg, seed=0)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T + 1))
    model.loss(ids[:, :-1], ids[:, 1:])
    kept = {}
    for layer in layers_of(model):
        buffers(layer._cache, kept)
    for state in (model.params.data, model.params.grads):    # weights seen through the layers' views
        kept.pop(id(state), None)
    total = sum(kept.values())
    outside = B * T * (cfg.vocab_size + 3 * cfg.d_model) * 4  # the logits, the final LayerNorm and head inputs
    per_layer = (total - outside) / (B * T * cfg.n_layer * cfg.d_model * 4)
    print(f"{name} at {B} x {T}: {total / 2**20:.1f} MiB kept; {per_layer:.2f} d_model floats per layer and token")


if __name__ == "__main__":
    main(sys.argv[1:])
