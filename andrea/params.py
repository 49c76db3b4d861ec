"""Print a config's exact parameter count and its breakdown: `python -m andrea.params 120m`.

Counts from the shapes alone (nothing is allocated); the tied token matrix is counted once.
"""

from andrea.cli import ArgumentParser, run_cli
from andrea.config import load_config
from andrea.model.sizes import format_breakdown


def main(argv=None):
    ap = ArgumentParser(prog="python -m andrea.params", description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default="tiny", help="tiny, small, 120m or a .yaml path")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--debug", action="store_true")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.set)
    m = cfg.model
    print(f"{cfg.name}: vocab {m.vocab_size}, context {m.context_length}, d_model {m.d_model}, "
          f"{m.n_layer} layers, {m.n_head} heads, mlp_dim {m.mlp_dim}")
    print(format_breakdown(m))


if __name__ == "__main__":
    run_cli(main)
