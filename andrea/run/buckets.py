"""The gradient buffer cut into buckets in the order the backward completes them: what the overlapped
reduction (andrea.run.trainer, `train.overlap`) starts one by one and what the scale-out pricing
(andrea.run.scaleout) prices.

    layout(shapes)                    # ({name: offset}, span): the flat buffer's offsets, as minitensor.flat lays them
    buckets(offsets, size, n_layer)   # [(start, stop), ...]: the top block (with ln_f and the padding), each
                                      # block down to block 0, then the embeddings

Each block's parameters are contiguous in the flat buffer (andrea.model.sizes.param_shapes: the
embeddings, block 0 ... block L-1, ln_f), so a block's bucket is one range, complete when that block's
backward ends. The tied embedding (wte, which the head reads) and wpe come first in the buffer and last
in the backward: their gradient is complete only after the embeddings' backward, so theirs is the last
bucket. The buckets cover [0, size) exactly, in order of readiness.
"""

from __future__ import annotations

import math

from minitensor.flat import ALIGN


def layout(shapes):
    """({name: offset}, span) of the flat buffer minitensor.flat.Params lays out for `shapes`, without
    allocating it: each tensor at a multiple of ALIGN elements."""
    offsets, offset = {}, 0
    for name, shape in shapes.items():
        offsets[name] = offset
        offset += -(-math.prod(shape) // ALIGN) * ALIGN
    return offsets, offset


def buckets(offsets, size, n_layer):
    """[(start, stop)] of the flat buffer of `size` elements, in the order the backward completes them:
    block n_layer - 1 (with ln_f after it and the buffer's padding), down to block 0, then [0, block 0's
    start): the embeddings. One bucket, the whole buffer, without blocks."""
    starts = [min(off for name, off in offsets.items() if name.startswith(f"transformer.h.{i}."))
              for i in range(n_layer)]
    if not starts:
        return [(0, size)]
    bounds = [*starts, size]
    return [(bounds[i], bounds[i + 1]) for i in reversed(range(n_layer))] + [(0, starts[0])]
