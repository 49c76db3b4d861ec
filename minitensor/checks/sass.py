"""The compiled code of a kernel read on the CPU: its sm_90 SASS, from the cubin NVRTC makes, through nvdisasm.

    read(spec, instance, dtype, arch)  -> Sass: instructions, HMMAs, branches inside the mma loop, and how
                                          far ahead of its HMMA each operand's shared-memory load is issued

The mma loop of a kernel is the stretch of its code from the first HMMA to the last one (in the flash
kernels, the products of one tile: q k^T, the softmax, P v); a branch there (`BRA`, `BRX`, `JMP`, `JMX`,
`CALL`, `RET`, `EXIT`) is one the tensor cores wait on, or one that keeps a fallback beside every product
(a run-time `tf32`, as the flash kernels had). For each register of an HMMA's A and B operands, the
instruction that last wrote it before the HMMA, in the code's order; where that is a shared-memory load
(`LDS`, `LDSM`), the operand's load-ahead distance is the number of instructions between the two (the
nearest of its registers' loads). A loop whose median distance is under `PIPELINED` issues each
fragment's load just before its product: every step waits out the shared-memory latency (~30 cycles)
where the tensor core could issue every ~4-6.

nvdisasm comes from NVIDIA's `nvidia-cuda-nvdisasm` wheel (the `kernel-check` extra) or the CUDA toolkit
on the PATH. NVRTC's cubin, as CuPy returns it, lacks its last byte: it is padded back to the size its
ELF headers give.
"""

import dataclasses
import functools
import glob
import os
import re
import shutil
import statistics
import subprocess
import tempfile


INSTALL_HINT = "pip install 'nvidia-cuda-nvdisasm>=13,<14'  (the kernel-check extra)"
PIPELINED = 8        # the median load-ahead (instructions) a pipelined mma loop reaches
BRANCHES = ("BRA", "BRX", "JMP", "JMX", "CALL", "RET", "EXIT")
LOADS = ("LDS", "LDSM")


class NvdisasmMissing(FileNotFoundError):
    """nvdisasm is neither on the PATH nor in the nvidia-cuda-nvdisasm wheel; the message says how to install."""


@functools.cache
def nvdisasm():
    """The path of nvdisasm: the PATH's, else the nvidia-cuda-nvdisasm wheel's."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia
        for root in nvidia.__path__:
            for path in sorted(glob.glob(os.path.join(root, "*", "bin", "nvdisasm"))):
                return path
    except ImportError:
        pass
    raise NvdisasmMissing(f"nvdisasm is not installed: {INSTALL_HINT}")


@dataclasses.dataclass(frozen=True)
class Instruction:
    opcode: str      # with its modifiers: HMMA.1688.F32.TF32, LDS.64, BRA
    written: tuple   # registers it writes (R numbers), from its first operand
    read: tuple      # registers of its other operands, in order, each as (first, count)

    @property
    def base(self):
        return self.opcode.split(".")[0]


def mangled(name, instance=()):
    """The symbol of a kernel in the cubin: `name` for an extern "C" kernel, else the Itanium mangling's
    prefix of the instance name<instance...> (int template arguments)."""
    if not instance:
        return name
    args = "".join(f"Li{v}E" if v >= 0 else f"Lin{-v}E" for v in instance)
    return f"_Z{len(name)}{name}I{args}E"


def whole_elf(cubin):
    """The cubin padded with zeros to the end of its section and program header tables."""
    if cubin[:4] != b"\x7fELF" or len(cubin) < 64:
        raise ValueError("not an ELF cubin")
    ph_off, sh_off = (int.from_bytes(cubin[o:o + 8], "little") for o in (32, 40))
    ph_size, ph_num, sh_size, sh_num = (int.from_bytes(cubin[o:o + 2], "little") for o in (54, 56, 58, 60))
    end = max(ph_off + ph_size * ph_num, sh_off + sh_size * sh_num)
    return cubin + b"\0" * max(0, end - len(cubin))


def disassemble(cubin):
    """{function symbol: [Instruction, ...]} of a cubin, in the code's order."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(whole_elf(cubin))
        proc = subprocess.run([nvdisasm(), "-c", path], capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"nvdisasm failed: {proc.stderr.strip()[-500:]}")
    return parse(proc.stdout)


_SECTION = re.compile(r"^\s*\.section\s+\.text\.(\S+?),")
_CODE = re.compile(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?)\s*;")
_REG = re.compile(r"\bR(\d+)\b")


def parse(text):
    """{function: [Instruction, ...]} from nvdisasm's text."""
    functions, current = {}, None
    for line in text.splitlines():
        if (m := _SECTION.match(line)):
            current = functions.setdefault(m.group(1), [])
        elif current is not None and (m := _CODE.search(line)):
            current.append(_instruction(m.group(1), m.group(2)))
    return functions


def _width(opcode):
    """Registers written by a load of this width (LDS.64: 2, LDS.128: 4, LDSM.16.M88.4: 4)."""
    if opcode.startswith("LDSM"):
        return int(opcode.rsplit(".", 1)[-1]) if opcode.rsplit(".", 1)[-1].isdigit() else 1
    bits = re.search(r"\.(64|128)\b", opcode)
    return int(bits.group(1)) // 32 if bits else 1


def _instruction(opcode, operands):
    parts = [p.strip() for p in operands.split(",")] if operands else []
    regs = [[int(r) for r in _REG.findall(p)] for p in parts]
    base = opcode.split(".")[0]
    if base == "HMMA":  # D, A (4 registers for m16n8k8 tf32 and m16n8k16 bf16), B (2), C
        read = tuple((r[0], n) for r, n in zip(regs[1:3], (4, 2)) if r)
        written = tuple(range(regs[0][0], regs[0][0] + 4)) if regs and regs[0] else ()
    elif base in ("LDS", "LDSM", "LDG", "LD", "LDL", "LDC"):
        written = tuple(range(regs[0][0], regs[0][0] + _width(opcode))) if regs and regs[0] else ()
        read = tuple((r, 1) for p in regs[1:] for r in p)
    else:
        written = tuple(regs[0][:1]) if regs and base not in BRANCHES and not base.startswith("ST") else ()
        read = tuple((r, 1) for p in regs[1:] for r in p)
    return Instruction(opcode, written, read)


@dataclasses.dataclass
class Sass:
    """What the sm_90 code of one kernel shows."""
    function: str
    instructions: int
    hmma: int
    loop: int                 # instructions from the first HMMA to the last
    branches: int             # branches among them
    ahead: tuple = ()         # load-ahead distance of each loaded HMMA operand

    @property
    def ahead_min(self):
        return min(self.ahead, default=0)

    @property
    def ahead_median(self):
        return statistics.median(self.ahead) if self.ahead else 0

    @property
    def pipelined(self):
        return bool(self.ahead) and self.ahead_median >= PIPELINED


def analyse(function, code):
    """The Sass of one function's instructions."""
    hmma = [i for i, ins in enumerate(code) if ins.base == "HMMA"]
    if not hmma:
        return Sass(function, len(code), 0, 0, 0)
    first, last = hmma[0], hmma[-1]
    branches = sum(code[i].base in BRANCHES for i in range(first, last + 1))
    writer, ahead = {}, []
    for i, ins in enumerate(code):
        if ins.base == "HMMA":
            for reg, count in ins.read:
                loads = [writer[r] for r in range(reg, reg + count) if r in writer]
                if loads and all(code[w].base in LOADS for w in loads):
                    ahead.append(i - max(loads))
        for r in ins.written:
            writer[r] = i
    return Sass(function, len(code), len(hmma), last - first + 1, branches, tuple(ahead))


def read(spec, instance=(), dtype=None, arch="sm_90"):
    """The Sass of one kernel (a template's instance) as NVRTC compiles its source for dtype (None: the first
    it is built in, kernelcheck.dtypes_of: float32, bfloat16 for the bf16 kernels) and arch."""
    from minitensor.checks.kernelcheck import compile_source, dtypes_of

    dtype = dtype or dtypes_of(spec)[0]
    cubin, _ = compile_source(spec.source(dtype), spec.name, spec.options, arch)
    functions = disassemble(cubin)
    symbol = mangled(spec.name, instance)
    found = [f for f in functions if f == symbol or (instance and f.startswith(symbol))]
    if len(found) != 1:
        raise RuntimeError(f"{spec.name}: {len(found)} functions named {symbol}* in its cubin ({', '.join(functions)})")
    return analyse(found[0], functions[found[0]])


def instance_for(spec, args):
    """The instance a launch with args runs, () for a plain kernel."""
    return spec.instance_of(args) if getattr(spec, "template", ()) else ()

