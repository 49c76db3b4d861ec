"""The gradient reduction of a data-parallel GPU step priced where it cannot be run: 8 GPUs over NVLink,
64 over InfiniBand; with and without the overlap of the backward (`train.overlap`); replicated and
ZeRO-1 (`train.zero_stage=1`).

    python -m andrea.run.stepmodel --scale-out        # the table: ANDREA-120M, 8 x 1024 per GPU
    price_step(parts, NVLINK, 8, overlap=True)        # a StepPrice from a step's priced parts

The compute of one GPU's step is the step model's (andrea.run.stepmodel: one micro-batch recorded on the
CuPy stand-in, each launch priced on an H200 or an H100, andrea.run.pricing); what this module adds is
the NCCL stream's time, from the bytes each collective moves and each link's measured bus bandwidth:

- a ring all-reduce of S bytes over N GPUs sends and receives 2 (N-1)/N S bytes per GPU, a reduce-scatter
  or an all-gather (N-1)/N S; nccl-tests defines the bus bandwidth so that a collective takes those
  bytes over it (busbw = algbw x 2(N-1)/N for the all-reduce, x (N-1)/N for the other two: NVIDIA/
  nccl-tests, doc/PERFORMANCE.md), so that one measured busbw prices all three; plus a fixed latency per
  collective where one was measured;
- without overlap the step's one all-reduce (ZeRO-1: one reduce-scatter) follows the backward: all of it
  is exposed;
- with overlap each bucket (andrea.run.buckets: the top block with ln_f, each block down, the tied
  embedding last) starts reducing when the backward has completed it, one after another on the one
  NCCL stream; the step waits for what is still running when the backward ends. The blocks' backward
  takes equal times; the last bucket, complete only after the embeddings' backward, can never hide.
  Without latency, the exposed time is never more than without overlap (the same bytes, started no
  later); with it, each bucket adds one, which stays hidden as long as a block's backward outlasts two
  latencies and the embeddings' backward one;
- ZeRO-1: a reduce-scatter of the gradients and an all-gather of the parameters, the same bytes as an
  all-reduce; the gradient norm and AdamW over 1/N of the buffer; the all-gather after the optimizer,
  exposed (nothing of the next step runs before it).

The links (each constant with its source):

- NVLINK: 8 H100 or H200 SXM on NVSwitch, NVLink 4: 900 GB/s per GPU both ways, 450 each way (NVIDIA's
  H100 and H200 datasheets). nccl-tests' all_reduce_perf measures a bus bandwidth of 460-480 GB/s at
  large sizes on 8 x H100 SXM5 (Alaya NeW, "NCCL-tests in practice", docs.alayanew.com tech blog,
  2026-05-06: reference figures for acceptance; NVLink SHARP lets it pass the 450 of a plain ring): the
  lower end, 460 GB/s. No measured latency of a small all-reduce on NVLink was found: none is priced (13
  collectives a step; NCCL's small all-reduces take tens of microseconds, well under the backward's
  tens of milliseconds).
- INFINIBAND: 8 nodes of 8 GPUs, each GPU with its own 400 Gb/s NDR ConnectX-7 (8 per node, DGX H100:
  NVIDIA's DGX H100 user guide; ~49 GB/s measured GPU to NIC, NVIDIA's DGX-H100 system notes): 400 GB/s
  out of a node each way, which bounds a ring's bus bandwidth once most of its hops leave the node. A
  two-node, 16 x H100 all-reduce measured 125 GB/s busbw at 10 MB, 304 at 100 MB and 435 at 1 GB, the
  1 MB one taking 0.088 ms (github.com/drmysore/nebius-h100-16gpu-benchmark, README, NCCL 2.20.5); a
  latency + bytes / busbw fit through 10 MB and 1 GB gives 0.113 ms and 425 GB/s (the 100 MB point lies
  14% slower than the fit). Priced: 400 GB/s (the NICs' bound, under the 2-node figure, whose rings
  cross NVLink more) and 0.113 ms per collective, the 16-GPU latency taken for 64 GPUs (a ring's grows
  with N; NCCL's tree does not as fast).
"""

from __future__ import annotations

import dataclasses

from andrea.run.buckets import buckets, layout

ALL_REDUCE, HALF = "all_reduce", "half"  # an all-reduce's bytes; a reduce-scatter's or an all-gather's


@dataclasses.dataclass(frozen=True)
class Link:
    name: str
    gpus: int                 # the GPUs of the priced run
    busbw: float              # bytes/s: nccl-tests' bus bandwidth of a large collective
    latency_s: float          # seconds each collective costs beyond its bytes


NVLINK = Link("8 GPUs, NVLink 4 (NVSwitch)", 8, busbw=460e9, latency_s=0.0)
INFINIBAND = Link("64 GPUs, 8 nodes x 8 NDR 400 Gb/s", 64, busbw=400e9, latency_s=0.113e-3)
LINKS = (NVLINK, INFINIBAND)


def bytes_per_gpu(nbytes, n, kind=ALL_REDUCE):
    """Bytes each of n GPUs sends (and receives) in a ring collective over nbytes: 2 (n-1)/n of them for an
    all-reduce, (n-1)/n for a reduce-scatter or an all-gather; 0 at one GPU."""
    return (2 if kind == ALL_REDUCE else 1) * (n - 1) / n * nbytes


def collective_seconds(nbytes, n, link, kind=ALL_REDUCE):
    """One collective's time on the link: its latency plus its bytes per GPU at the bus bandwidth."""
    return 0.0 if n == 1 else link.latency_s + bytes_per_gpu(nbytes, n, kind) / link.busbw


@dataclasses.dataclass(frozen=True)
class StepParts:
    """A GPU's step, priced by parts (seconds): one micro-batch's forward; its backward before the blocks
    (cross-entropy, head, ln_f), of one block, and of the embeddings; zero_grad; the gradient norm and
    clip; AdamW. bucket_bytes: the gradient buckets in the order the backward completes them."""
    forward: float
    head_backward: float
    block_backward: float
    embedding_backward: float
    zero_grad: float
    norm: float
    adamw: float
    bucket_bytes: tuple

    @property
    def backward(self):
        return self.head_backward + len(self.bucket_bytes[:-1]) * self.block_backward + self.embedding_backward


@dataclasses.dataclass(frozen=True)
class StepPrice:
    compute: float            # forward and backward of the GPU's micro-batches
    optimizer: float          # zero_grad, norm and clip, AdamW (ZeRO-1: the last two over 1/N)
    reduction: float          # the NCCL stream's busy time for the gradients (and ZeRO-1's all-gather)
    exposed: float            # of which the step waits for
    bytes_per_gpu: float      # sent by each GPU per step

    @property
    def step(self):
        return self.compute + self.optimizer + self.exposed


def exposed_after_backward(parts, n, link, kind):
    """(busy seconds, seconds past the backward's end) of the buckets reduced one after another on one
    stream, each started when the backward has completed it."""
    ready = parts.head_backward
    free = busy = 0.0
    for i, nbytes in enumerate(parts.bucket_bytes):
        ready = parts.backward if i == len(parts.bucket_bytes) - 1 else ready + parts.block_backward
        t = collective_seconds(nbytes, n, link, kind)
        free, busy = max(free, ready) + t, busy + t
    return busy, max(0.0, free - parts.backward)


def price_step(parts, link, n=None, overlap=False, zero=False, micro_batches=1):
    """The StepPrice of one GPU's step of `micro_batches` micro-batches over n GPUs (default the link's) on
    the link: overlap as `train.overlap`, zero as `train.zero_stage=1`."""
    n = n or link.gpus
    total = float(sum(parts.bucket_bytes))
    kind = HALF if zero else ALL_REDUCE
    if overlap:
        busy, exposed = exposed_after_backward(parts, n, link, kind)
    else:
        busy = exposed = collective_seconds(total, n, link, kind)
    sent = bytes_per_gpu(total, n, kind)
    if zero:  # the parameters all-gathered after AdamW, before the next forward
        gather = collective_seconds(total, n, link, HALF)
        busy, exposed, sent = busy + gather, exposed + gather, sent + bytes_per_gpu(total, n, HALF)
    share = 1 / n if zero else 1.0
    optimizer = parts.zero_grad + share * (parts.norm + parts.adamw)
    return StepPrice(micro_batches * (parts.forward + parts.backward), optimizer, busy, exposed, sent)


def bucket_bytes(cfg, itemsize=4):
    """The gradient buckets' bytes of a model config, in the order the backward completes them."""
    from andrea.model.sizes import param_shapes

    offsets, span = layout(param_shapes(cfg))
    return tuple(itemsize * (stop - start) for start, stop in buckets(offsets, span, cfg.n_layer))


def parts_from_estimate(est, cfg):
    """StepParts from a step model estimate (andrea.run.stepmodel.estimate) of a one-micro-batch record."""
    seconds = {"forward": 0.0, "head": 0.0, "block": 0.0, "embeddings": 0.0, "zero_grad": 0.0, "norm": 0.0,
               "adamw": 0.0}
    for (_which, part, phase), v in est["rows"].items():
        total = v[5]
        if phase == "forward":
            seconds["forward"] += total
        elif phase == "backward":
            key = "block" if part.startswith("block:") else "embeddings" if part == "embeddings" else "head"
            seconds[key] += total
        else:
            key = {"zero_grad": "zero_grad", "grad norm and clip": "norm", "adamw": "adamw"}.get(part, "zero_grad")
            seconds[key] += total
    return StepParts(seconds["forward"], seconds["head"], seconds["block"] / cfg.n_layer, seconds["embeddings"],
                     seconds["zero_grad"], seconds["norm"], seconds["adamw"], bucket_bytes(cfg))


# llm.c's published multi-GPU runs of GPT-2 (124M), 10B tokens of FineWeb, bf16 with cuDNN's flash
# attention and ZeRO-1 (-z 1): ~90 minutes on 8 x A100 80GB SXM (karpathy/llm.c discussion 481,
# "Reproducing GPT-2 (124M) in llm.c in 90 minutes for $20", 2024-05-28) and 45 minutes on 8 x H100
# (the figure KellerJordan/modded-nanogpt's README gives for the llm.c replication): tokens per second of
# the whole run, the reduction inside. They publish no reduction time alone.
LLMC = (("llm.c GPT-2 124M, 8 x A100 SXM (bf16)", 10e9 / (90 * 60)), ("llm.c GPT-2 124M, 8 x H100 (bf16)",
                                                                       10e9 / (45 * 60)))


def table(parts, tokens_per_micro_batch, hw_name):
    """The lines of the scale-out table for one card: each link, replicated and ZeRO-1, without and with
    overlap; llm.c's published figures beneath."""
    one = price_step(parts, NVLINK, 1)
    lines = [f"{hw_name}: one GPU, one micro-batch of {tokens_per_micro_batch:,} tokens: compute "
             f"{1e3 * one.compute:.1f} ms, optimizer {1e3 * one.optimizer:.1f} ms; gradient "
             f"{sum(parts.bucket_bytes) / 1e6:.0f} MB in {len(parts.bucket_bytes)} buckets",
             f"{'link':<36} {'run':<22} {'GB/GPU':>7} {'NCCL ms':>8} {'waited ms':>9} {'step ms':>8} "
             f"{'M tok/s':>8} {'scaling':>7}"]
    for link in LINKS:
        for zero in (False, True):
            for overlap in (False, True):
                p = price_step(parts, link, link.gpus, overlap, zero)
                tok_s = link.gpus * tokens_per_micro_batch / p.step
                run = ("ZeRO-1" if zero else "replicated") + (", overlap" if overlap else "")
                lines.append(f"{link.name:<36} {run:<22} {p.bytes_per_gpu / 1e9:>7.2f} {1e3 * p.reduction:>8.2f} "
                             f"{1e3 * p.exposed:>9.2f} {1e3 * p.step:>8.1f} {tok_s / 1e6:>8.2f} "
                             f"{one.step / p.step:>7.0%}")
    for name, tok_s in LLMC:
        lines.append(f"{name:<59} {'':>7} {'':>8} {'':>9} {'':>8} {tok_s / 1e6:>8.2f}   (whole run, published)")
    return lines
