"""The figures of the tools that draw (`andrea.plot`, its `--grad-flow`, `andrea.experiment`), with
matplotlib imported on use: it is an optional extra (`pip install -e '.[plot]'`)."""

from andrea.errors import UserError


def require_matplotlib(tool: str) -> None:
    """A UserError naming `tool` and the extra to install when matplotlib is missing; asked before
    any work whose result would be a figure."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError(f"{tool} needs matplotlib: pip install -e '.[plot]'") from None


def new_figure(tool: str, figsize: tuple[float, float], dpi: int = 100):
    """A matplotlib Figure drawn off-screen (Agg: no display needed), its subplots laid out to fit."""
    require_matplotlib(tool)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def label_depth_axis(ax, title: str) -> None:
    """The axes of a gradient-norm-against-depth plot (the gradient flow's and the experiments')."""
    ax.set_yscale("log")
    ax.set_xlabel("block input (0 = embeddings; last = top of the stack)")
    ax.set_ylabel("|dL/dx|")
    ax.set_title(title)
