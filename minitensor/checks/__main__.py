"""The command line of the CUDA kernel checks, which need no GPU (minitensor/checks/kernelcheck.py).

    python -m minitensor.checks               lists the registered kernels
    python -m minitensor.checks --check       NVRTC compiles every kernel x dtype x arch
    python -m minitensor.checks --host-check  g++ runs each elementwise operation on the CPU
                                               and compares it with its reference, the Ops code

The kernels themselves live in minitensor/backends/kernels/ (a .cu and a .py each); the registry is
`minitensor.backends.cuda.KERNELS` (minitensor.backends.all_kernels()).
"""
import argparse
import sys

from minitensor.backends import all_kernels, cuda


class _Parser(argparse.ArgumentParser):
    """A bad flag is one line, `error: ...` (exit 2), as in every andrea command, not the usage block."""

    def error(self, message):
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def main(argv=None):
    parser = _Parser(prog="python -m minitensor.checks", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="NVRTC-compile every kernel (no GPU needed)")
    parser.add_argument("--host-check", action="store_true", help="run elementwise operations as C++ vs NumPy")
    parser.add_argument("--arch", nargs="+", default=list(cuda.ARCHS), help="GPU archs to compile for (sm_XX)")
    args = parser.parse_args(argv)
    from minitensor.checks import kernelcheck  # here: the library never needs it

    if not (args.check or args.host_check):
        print("kernels:", ", ".join(all_kernels()))
        parser.print_usage()
        return 0
    return kernelcheck.run(host=args.host_check, archs=args.arch if args.check else None)


if __name__ == "__main__":
    sys.exit(main())
