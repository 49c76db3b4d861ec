"""The scale-out pricing (andrea.run.scaleout): how the reduction's price behaves, not its figures."""

import dataclasses

import numpy as np
import pytest

from andrea.config import load_config
from andrea.model.sizes import param_shapes
from andrea.run import scaleout
from andrea.run.buckets import buckets, layout
from andrea.run.scaleout import INFINIBAND, LINKS, NVLINK, StepParts, bytes_per_gpu, price_step
from minitensor.flat import Params


def random_parts(rng, latency):
    """A step's parts drawn at random, each block's backward at least two collectives' latencies and the
    embeddings' one (where the buckets' latencies stay hidden)."""
    n_buckets = int(rng.integers(2, 30))
    return StepParts(forward=rng.uniform(1e-3, 0.1), head_backward=rng.uniform(0, 0.02),
                     block_backward=2 * latency + rng.uniform(0, 0.01),
                     embedding_backward=latency + rng.uniform(0, 1e-3),
                     zero_grad=rng.uniform(0, 1e-3), norm=rng.uniform(0, 1e-3), adamw=rng.uniform(0, 5e-3),
                     bucket_bytes=tuple(rng.uniform(1e3, 1e9, n_buckets)))


def test_bytes_per_gpu_grow_with_the_gpus_towards_twice_the_gradient():
    size = 369e6
    ratios = [bytes_per_gpu(size, n) / size for n in (1, 2, 3, 8, 64, 1024, 10**6)]
    assert ratios[0] == 0 and ratios[1] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(ratios, ratios[1:]))
    assert all(r < 2 for r in ratios) and ratios[-1] == pytest.approx(2, rel=1e-5)


@pytest.mark.parametrize("link", LINKS, ids=lambda link: link.name)
@pytest.mark.parametrize("zero", [False, True])
def test_overlap_is_never_slower(link, zero):
    rng = np.random.default_rng(0)
    for _ in range(500):
        parts, n = random_parts(rng, link.latency_s), int(rng.integers(2, 128))
        without, with_ = (price_step(parts, link, n, overlap, zero) for overlap in (False, True))
        assert with_.exposed <= without.exposed * (1 + 1e-12)
        assert with_.step <= without.step * (1 + 1e-12)
        assert with_.bytes_per_gpu == pytest.approx(without.bytes_per_gpu)


@pytest.mark.parametrize("zero", [False, True])
def test_overlap_is_never_slower_on_a_link_without_latency_whatever_the_backward(zero):
    rng = np.random.default_rng(3)
    free = dataclasses.replace(INFINIBAND, latency_s=0.0)
    for _ in range(500):
        parts = dataclasses.replace(random_parts(rng, 0.0), block_backward=rng.uniform(0, 1e-3) ** 3,
                                    embedding_backward=0.0)
        n = int(rng.integers(2, 128))
        assert (price_step(parts, free, n, True, zero).exposed
                <= price_step(parts, free, n, False, zero).exposed * (1 + 1e-12))


def test_overlap_hides_all_but_the_last_bucket_behind_a_long_backward():
    parts = StepParts(0.01, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, bucket_bytes=(1e9,) * 12 + (2e8,))
    last = scaleout.collective_seconds(2e8, 8, NVLINK)
    assert price_step(parts, NVLINK, 8, overlap=True).exposed == pytest.approx(last)
    assert price_step(parts, NVLINK, 8).exposed == pytest.approx(scaleout.collective_seconds(sum(parts.bucket_bytes), 8,
                                                                                              NVLINK))


@pytest.mark.parametrize("link", LINKS, ids=lambda link: link.name)
def test_zero1_moves_the_bytes_of_an_all_reduce_and_divides_the_optimizer(link):
    rng = np.random.default_rng(1)
    for n in (2, 3, 8, 64):
        parts = random_parts(rng, link.latency_s)
        replicated, zero = price_step(parts, link, n), price_step(parts, link, n, zero=True)
        assert zero.bytes_per_gpu == pytest.approx(replicated.bytes_per_gpu)
        free = dataclasses.replace(link, latency_s=0.0)
        assert price_step(parts, free, n, zero=True).reduction == pytest.approx(price_step(parts, free, n).reduction)
        assert zero.optimizer == pytest.approx(parts.zero_grad + (parts.norm + parts.adamw) / n)


def test_one_gpu_reduces_nothing():
    parts = random_parts(np.random.default_rng(2), INFINIBAND.latency_s)
    for overlap in (False, True):
        price = price_step(parts, INFINIBAND, 1, overlap)
        assert price.reduction == price.exposed == price.bytes_per_gpu == 0


@pytest.mark.parametrize("config", ["tiny", "small", "120m"])
def test_the_buckets_are_each_blocks_range_in_the_order_the_backward_completes_them(config):
    cfg = load_config(config).model
    shapes = param_shapes(cfg)
    offsets, span = layout(shapes)
    if config == "tiny":  # the layout is the flat buffer's own
        params = Params(shapes, multiple=48)
        assert offsets == params.offsets and span == params.span
    size = span + 32
    bounds = buckets(offsets, size, cfg.n_layer)
    assert len(bounds) == cfg.n_layer + 1 and bounds[0][1] == size and bounds[-1][0] == 0
    assert all(a[0] == b[1] for a, b in zip(bounds, bounds[1:]))  # contiguous, from the top of the buffer down
    for i, (start, stop) in enumerate(bounds[:-1]):
        block = cfg.n_layer - 1 - i
        inside = {name for name, off in offsets.items() if start <= off < stop}
        assert {n for n in inside if n.startswith("transformer.h.")} == {n for n in shapes
                                                                         if n.startswith(f"transformer.h.{block}.")}
    assert {name for name, off in offsets.items() if off < bounds[-1][1]} == {"transformer.wte.weight",
                                                                             "transformer.wpe.weight"}


def test_the_parts_of_an_estimate_sum_to_its_step():
    cfg = load_config("tiny").model
    rows = {("first", "block: mlp", "backward"): [0] * 5 + [0.4], ("first", "block: mlp", "forward"): [0] * 5 + [0.2],
            ("first", "head", "backward"): [0] * 5 + [0.1], ("first", "embeddings", "backward"): [0] * 5 + [0.05],
            ("step", "adamw", "step"): [0] * 5 + [0.03], ("step", "grad norm and clip", "step"): [0] * 5 + [0.02],
            ("step", "zero_grad", "step"): [0] * 5 + [0.01]}
    parts = scaleout.parts_from_estimate({"rows": rows}, cfg)
    price = price_step(parts, NVLINK, 1)
    assert price.step == pytest.approx(sum(v[5] for v in rows.values()))
    assert parts.block_backward == pytest.approx(0.4 / cfg.n_layer)
    assert sum(parts.bucket_bytes) == 4 * layout(param_shapes(cfg))[1]
