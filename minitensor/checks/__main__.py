"""The command line of the CUDA kernel checks, which need no GPU (minitensor/checks/kernelcheck.py).

    python -m minitensor.checks               lists the registered kernels
    python -m minitensor.checks --check       NVRTC compiles every kernel x dtype x arch
    python -m minitensor.checks --host-check  g++ runs each elementwise operation on the CPU
                                               and compares it with its reference, the Ops code

The kernels themselves live in minitensor/backends/kernels/ (a .cu and a .py each); the registry is
`minitensor.backends.cuda.KERNELS` (minitensor.backends.all_kernels()).
    python -m minitensor.checks --counts      every kernel's registers, spills, shared memory and
                                               occupancy (ptxas, sm_90), and each RawKernel's
                                               shared-memory wavefronts, L2 sectors and mma.sync steps
                                               counted at ANDREA-120M's shapes (minitensor/checks/counts.py);
                                               exit 1 if a kernel spills in float32 or has a request more
                                               conflicted than its spec declares; and each kernel's sm_90
                                               SASS (nvdisasm, minitensor/checks/sass.py): exit 1 on a
                                               branch in an mma loop, an unpipelined one, or fewer warps
                                               per SM than the kernel declares

"""
import argparse
import re
import sys

from minitensor.backends import all_kernels, cuda

# The architectures NVRTC 13 compiles for that the kernels may run on (their mma.sync needs sm_80+).
KNOWN_ARCHS = ("sm_80", "sm_86", "sm_87", "sm_89", "sm_90", "sm_100", "sm_103", "sm_110", "sm_120", "sm_121")


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
    parser.add_argument("--counts", nargs="*", metavar="KERNEL",
                        help="count what every kernel (or those named) asks of an H200 at ANDREA-120M's shapes")
    args = parser.parse_args(argv)
    bad = [a for a in args.arch if not re.fullmatch(r"sm_\d+a?", a) or a.rstrip("a") not in KNOWN_ARCHS]
    if bad:
        parser.error(f"--arch {bad[0]!r} is not an architecture the kernels compile for: choose from "
                     f"{', '.join(KNOWN_ARCHS)}")
    from minitensor.checks import kernelcheck  # here: the library never needs it

    if not (args.check or args.host_check or args.counts is not None):
        print("kernels:", ", ".join(all_kernels()))
        parser.print_usage()
        return 0
    status = 0
    if args.check or args.host_check:
        status = kernelcheck.run(host=args.host_check, archs=args.arch if args.check else None)
    if args.counts is not None and status != 2:
        status = max(status, _counts(parser, args.counts))
    return status


def _counts(parser, names):
    from minitensor.checks import counts, sass

    unknown = sorted(set(names) - set(all_kernels()))
    if unknown:
        parser.error(f"unknown kernel {unknown[0]!r}: choose from {', '.join(all_kernels())}")
    try:
        rows = counts.count_all(names=names or None)
    except (cuda.ToolchainMissing, sass.NvdisasmMissing) as e:
        print(f"error: cannot read the kernels' registers and code: {e}", file=sys.stderr)
        return 2
    print("\n".join(counts.table(rows)))
    found = counts.problems(rows)
    for line in found:
        print(f"FAIL {line}")
    print(f"{len(found)} kernels break their declarations" if found else
          f"{len(rows)} kernels: no spill, no request more conflicted than declared, the occupancy "
          f"declared, no branch in an mma loop, every mma loop pipelined")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
