"""The compiled code read on the CPU (minitensor/checks/sass.py, `--counts`): branches inside the mma loop,
load-ahead of HMMA operands, occupancy from registers; a planted run-time branch refused, a pipelined loop
passed."""

import pytest
from markers import needs_nvrtc, nvdisasm_or_skip

from minitensor.backends import cuda
from minitensor.checks import counts, sass

MMA = r"""
__device__ __forceinline__ void mma_tf32(float *c, const unsigned *a, const unsigned *b) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
extern "C" __global__ void planted(const T *x, T *y, const int k) {
  __shared__ __align__(16) T s[2048];
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  for (int i = lane; i < 2048; i += 32) s[i] = x[i % 1024];
  __syncthreads();
  float c[8][4] = {};
START
#pragma unroll 1
  for (int step = 0; step < k; ++step) {
BODY
  }
  for (int n = 0; n < 8; ++n) y[32 * n + lane] = c[n][0] + c[n][1] + c[n][2] + c[n][3];
}
"""

# each product's fragments loaded just before it, and a run-time choice between the tensor core and FMAs
# (the flash kernels' old `tf32` argument)
BRANCHED = r"""
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      const unsigned a[4] = {__float_as_uint(s[g * 68 + t]), __float_as_uint(s[(g + 8) * 68 + t]),
                             __float_as_uint(s[g * 68 + t + 4]), __float_as_uint(s[(g + 8) * 68 + t + 4])};
      const unsigned b[2] = {__float_as_uint(s[(8 * n + g) * 68 + t + step]), __float_as_uint(s[(8 * n + g) * 68 + t + 4])};
      if (k & 1) mma_tf32(c[n], a, b);
      else for (int e = 0; e < 4; ++e) c[n][e] += __shfl_sync(0xffffffffu, __uint_as_float(a[e]) * __uint_as_float(b[e & 1]), e);
    }"""

# every fragment of the step loaded first, then the 8 products: batched in the source, but the compiler is free
# to issue each load just before its product again (it does, under no register pressure)
BATCHED = r"""
    unsigned a[4] = {__float_as_uint(s[g * 68 + t + step]), __float_as_uint(s[(g + 8) * 68 + t]),
                     __float_as_uint(s[g * 68 + t + 4]), __float_as_uint(s[(g + 8) * 68 + t + 4])};
    unsigned b[8][2];
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      b[n][0] = __float_as_uint(s[(8 * n + g) * 68 + t + step]);
      b[n][1] = __float_as_uint(s[(8 * n + g) * 68 + t + 4 + step]);
    }
#pragma unroll
    for (int n = 0; n < 8; ++n) mma_tf32(c[n], a, b[n]);"""

# software-pipelined: the next step's fragments loaded before this step's products, which use the
# fragments loaded one iteration earlier (carried in registers)
PIPELINED = r"""
    unsigned next[8][2];
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      next[n][0] = __float_as_uint(s[(8 * n + g) * 68 + t + step + 1]);
      next[n][1] = __float_as_uint(s[(8 * n + g) * 68 + t + 5 + step]);
    }
#pragma unroll
    for (int n = 0; n < 8; ++n) mma_tf32(c[n], a, b[n]);
#pragma unroll
    for (int n = 0; n < 8; ++n) b[n][0] = next[n][0], b[n][1] = next[n][1];"""

PIPELINE_START = r"""
  const unsigned a[4] = {__float_as_uint(s[g * 68 + t]), __float_as_uint(s[(g + 8) * 68 + t]),
                         __float_as_uint(s[g * 68 + t + 4]), __float_as_uint(s[(g + 8) * 68 + t + 4])};
  unsigned b[8][2];
  for (int n = 0; n < 8; ++n) b[n][0] = __float_as_uint(s[(8 * n + g) * 68 + t]), b[n][1] = __float_as_uint(s[(8 * n + g) * 68 + t + 4]);"""


def planted(body, start=""):
    return cuda.RawSpec("planted", inline=MMA.replace("START", start).replace("BODY", body))


@needs_nvrtc
def test_a_run_time_branch_in_the_mma_loop_is_refused():
    nvdisasm_or_skip()
    code = sass.read(planted(BRANCHED))
    assert code.hmma >= 8 and code.branches > 0
    row = counts.KernelCounts("planted", "raw", counts.Resources(32, 0, 0, 0, 0), 32, None, 1, code=code)
    assert any("branches inside its mma loop" in p for p in counts.problems([row]))


@needs_nvrtc
def test_a_pipelined_mma_loop_passes():
    nvdisasm_or_skip()
    code = sass.read(planted(PIPELINED, PIPELINE_START))
    assert code.hmma == 8 and code.branches == 0
    assert code.pipelined and code.ahead_median >= sass.PIPELINED, code.ahead
    row = counts.KernelCounts("planted", "raw", counts.Resources(32, 0, 0, 0, 0), 32, None, 1, code=code)
    assert counts.problems([row]) == []


@needs_nvrtc
def test_loads_batched_in_the_source_but_issued_just_before_their_products_are_refused():
    """What the source says is not what runs: the SASS shows each B fragment loaded 1-2 instructions ahead."""
    nvdisasm_or_skip()
    code = sass.read(planted(BATCHED))
    assert code.hmma == 8 and code.branches == 0 and not code.pipelined, code.ahead
    row = counts.KernelCounts("planted", "raw", counts.Resources(32, 0, 0, 0, 0), 32, None, 1, code=code)
    assert any("not pipelined" in p for p in counts.problems([row]))


@needs_nvrtc
def test_the_flash_kernels_have_no_branch_in_their_mma_loop_and_reach_their_occupancy():
    nvdisasm_or_skip()
    from minitensor.backends.kernels import attention

    for spec in (attention.FLASH_FWD, attention.FLASH_BWD_DQ, attention.FLASH_BWD_DKV):
        code = sass.read(spec, (64, 1))
        assert code.hmma and code.branches == 0 and code.pipelined, spec.name
        assert counts.occupancy_of(spec).warps >= spec.warps_per_sm > 0, spec.name


def test_the_sass_reader_counts_branches_and_load_ahead_on_known_text():
    """Hand-written nvdisasm lines: an operand loaded 3 instructions ahead, one 1 ahead, one from a register
    move (not a load: not counted), and a branch between the two HMMAs."""
    text = """
        .section	.text.k,"ax",@progbits
        /*0000*/                   LDS.64 R8, [R2] ;
        /*0010*/                   LDS R4, [R2+0x10] ;
        /*0020*/                   LDS R5, [R2+0x20] ;
        /*0030*/                   LDS R6, [R2+0x30] ;
        /*0040*/                   LDS R7, [R2+0x40] ;
        /*0050*/                   HMMA.1688.F32.TF32 R12, R4, R8, RZ ;
        /*0060*/              @P0 BRA `(.L_x_1) ;
        /*0070*/                   MOV R10, R3 ;
        /*0080*/                   MOV R11, R3 ;
        /*0090*/                   HMMA.1688.F32.TF32 R12, R4, R10, R12 ;
        /*00a0*/                   EXIT ;
"""
    [(name, code)] = sass.parse(text).items()
    found = sass.analyse(name, code)
    assert (name, found.instructions, found.hmma, found.loop, found.branches) == ("k", 11, 2, 5, 1)
    # HMMA 1: A (R4..R7, last loaded at 4) 1 ahead, B (R8, R9 at 0) 5 ahead; HMMA 2: A 5 ahead, B moved
    assert sorted(found.ahead) == [1, 5, 5]
    assert found.ahead_min == 1 and not found.pipelined


def test_a_kernel_under_its_declared_occupancy_is_named():
    res = counts.Resources(210, 0, 0, 0, 35072)
    occ = counts._occupancy(210, 128, 35072)
    row = counts.KernelCounts("k", "raw", res, 128, occ, 1, warps_declared=12)
    assert occ.warps == 8 and any("8 warps per SM" in p and "under the 12" in p for p in counts.problems([row]))


@pytest.mark.parametrize("registers, threads, shared, warps", [
    (128, 256, 34816, 16),   # the forward now: 4096 registers a warp, 2 blocks of 8 warps
    (158, 256, 34816, 8),    # the forward with tf32 at run time: 5120 a warp, 1 block
    (162, 128, 34816, 12),   # bwd_dq: 5376 a warp, 3 blocks of 4
    (168, 128, 34816, 12),
    (210, 128, 35072, 8),    # bwd_dkv: 6912 a warp, 2 blocks
    (228, 128, 35072, 8),
    (124, 256, 34816, 16),
    (64, 256, 34816, 32),    # 4 blocks by registers, 6 by shared memory (36 KB a block of 228 KB)
])
def test_occupancy_on_known_register_counts(registers, threads, shared, warps):
    assert counts._occupancy(registers, threads, shared).warps == warps


def test_instances_are_found_by_their_mangled_names():
    assert sass.mangled("flash_attention_fwd", (64, 1)) == "_Z19flash_attention_fwdILi64ELi1EE"
    assert sass.mangled("gelu_fwd") == "gelu_fwd"
