"""Gradient flow through the blocks, measured while training (train.log_grad_flow) and drawn.

At each log step of a run with train.log_grad_flow: true, the model reports one forward and
backward (the step's last micro-batch) to a GradFlow (ANDREA.record_flow) and metrics.jsonl's
record of that step gets a "grad_flow" entry:

    grad_top     |dL/dx| at the top of the stack (the last block's output)
    grad_in      [|dL/dx| at block 0's input (the embeddings), block 1's, ...]
    stream_rms   [the root mean square of the residual stream entering each block]
    attn_delta   [|attention's change to the stream| / |stream|, per block]
    mlp_delta    [the same for the MLP]

The gradients are of the micro-batch's share of the loss (1 / micro-batches of it); ratios such as
grad_in[0] / grad_top do not depend on that. Off (the default), training pays one flag test a step.

`python -m andrea.plot --grad-flow RUN [RUN ...]` draws, per run, the gradient norm against depth
at the logged steps (lighter: earlier) and the ratio of the embeddings' gradient to the top's over
training, one colour per run.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from andrea.errors import UserError
from andrea.files import atomic_writer
from andrea.run.figure import label_depth_axis, new_figure


class GradFlow:
    """How the residual stream and its gradient change through the blocks, in one forward and
    backward (the last micro-batch's when there are several). Per block i, from its input x:

        stream_rms[i]   sqrt(mean(x^2)), the size of the stream entering block i
        attn_delta[i]   |attn's change to the stream| / |x|: |s1 - x| / |x| with a skip, |s1| / |x|
                        without (s1: x + attn(...) pre-norm, before ln_1 post-norm)
        mlp_delta[i]    the same for the MLP, relative to the stream it changes (x1)
        grad_in[i]      |dL/dx|, the gradient reaching block i's input; grad_in[0] is the one that
                        reaches the embeddings
        grad_top        |dL/dx| at the top of the stack (the last block's output)

    Norms are Frobenius norms over the whole (B, T, C) tensor, read to the host: a few
    synchronisations per recorded step, none when not recording.
    """

    def __init__(self, n_layer):
        self.stream_rms, self.attn_delta, self.mlp_delta, self.grad_in = ([None] * n_layer for _ in range(4))
        self.grad_top = None

    @staticmethod
    def _norm(a):
        return float(a.ravel() @ a.ravel()) ** 0.5

    def forward(self, i, x, s1, x1, s2, skip):
        nx, nx1 = self._norm(x), self._norm(x1)
        self.stream_rms[i] = nx / x.size ** 0.5
        self.attn_delta[i] = self._norm(s1 - x if skip else s1) / max(nx, 1e-30)
        self.mlp_delta[i] = self._norm(s2 - x1 if skip else s2) / max(nx1, 1e-30)

    def backward(self, i, dx):
        self.grad_in[i] = self._norm(dx)

    def top(self, dx):
        self.grad_top = self._norm(dx)

    def as_dict(self):
        return {"grad_top": self.grad_top, "grad_in": self.grad_in, "stream_rms": self.stream_rms,
                "attn_delta": self.attn_delta, "mlp_delta": self.mlp_delta}


@contextlib.contextmanager
def recording(model, step, train_cfg):
    """Within the block, model reports its forward/backward to a fresh GradFlow when `step` is one the
    training loop logs (step 1, every log_interval, the last) and log_grad_flow is on; yields it,
    or None."""
    t = train_cfg
    logged = step == 1 or step % t.log_interval == 0 or step == t.max_steps
    if not (t.log_grad_flow and logged):
        yield None
        return
    flow = GradFlow(model.cfg.n_layer)
    model.record_flow(flow)
    try:
        yield flow
    finally:
        model.record_flow(None)  # evaluation's forwards are not measured


FLOW_LISTS = ("grad_in", "stream_rms", "attn_delta", "mlp_delta")  # one number per block each


def check_flow(flow: dict, where: str) -> dict:
    """`flow` (a grad_flow record) if it holds every key above, of its kind: grad_top a number, the
    lists one number per block; else a UserError naming `where` and the first key that is not so."""
    def number(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    if not number(flow.get("grad_top")):
        raise UserError(f"{where}: its grad_flow has no 'grad_top' (a number): the file is damaged, or not written by "
                        "andrea.train")
    blocks = flow.get("grad_in")
    for key in FLOW_LISTS:
        value = flow.get(key)
        if not (isinstance(value, list) and value and all(number(x) for x in value)
                and len(value) == len(blocks)):
            raise UserError(f"{where}: its grad_flow has no {key!r} (a list of one number per block): the file is "
                            "damaged, or not written by andrea.train")
    return flow


def embedding_ratio(flow: dict) -> float:
    """|dL/dx| reaching the embeddings over |dL/dx| at the top of the stack."""
    return flow["grad_in"][0] / flow["grad_top"] if flow["grad_top"] else float("nan")


def read_flow(run_dir) -> list[tuple[int, dict]]:
    """[(step, grad_flow record)] of a run, in step order; a UserError when it has none."""
    from andrea.run.metrics import by_step, read_records

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{path} does not exist: give the --out directory of a training run")
    records = sorted(by_step(read_records(path, strict=True)).items())
    flows = [(step, check_flow(r["grad_flow"], f"{path} step {step}")) for step, r in records
             if isinstance(r.get("grad_flow"), dict)]
    if not flows:
        raise UserError(f"{path} has no gradient flow: train with --set train.log_grad_flow=true")
    return flows


def draw_flow(runs: dict[str, list[tuple[int, dict]]]):
    """A Figure: gradient norm against depth (left), the embeddings' share over training (right)."""
    fig = new_figure("andrea.plot", figsize=(10, 4.2))
    depth_ax, time_ax = fig.subplots(1, 2)
    for i, (label, flows) in enumerate(runs.items()):
        colour = f"C{i % 10}"
        for k, (step, f) in enumerate(flows):
            layers = list(range(len(f["grad_in"]))) + [len(f["grad_in"])]
            last = k == len(flows) - 1
            depth_ax.plot(layers, f["grad_in"] + [f["grad_top"]], color=colour, lw=2 if last else 0.8,
                          alpha=1.0 if last else 0.15 + 0.5 * k / len(flows),
                          label=f"{label} (step {step})" if last else None)
        time_ax.plot([s for s, _ in flows], [embedding_ratio(f) for _, f in flows], color=colour, lw=2,
                     marker="o", ms=3, label=label)
    label_depth_axis(depth_ax, "gradient norm against depth (lighter: earlier steps)")
    time_ax.set_yscale("log")
    time_ax.set_xlabel("step")
    time_ax.set_ylabel("|dL/dx| at the embeddings / at the top")
    time_ax.set_title("the gradient that reaches the embeddings")
    for ax in (depth_ax, time_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return fig


def plot_flow(run_dirs, out, metadata=None) -> Path:
    """Draw the runs' gradient flow into the PNG `out` (written atomically, with the PNG text
    `metadata`); returns its path. `python -m andrea.plot --grad-flow` checks `out` first."""
    runs = {}
    for d in run_dirs:
        label = Path(d).name or str(d)
        runs[label if label not in runs else str(d)] = read_flow(d)
    buffer = io.BytesIO()
    draw_flow(runs).savefig(buffer, format="png", metadata=metadata)
    out = Path(out)
    with atomic_writer(out) as f:
        f.write(buffer.getvalue())
    return out
