"""What a GPU would find, counted on the CPU (minitensor/checks/traffic.py, the emulation's counting build, and
minitensor/checks/counts.py): shared-memory wavefronts as 32 banks of 4 bytes serve them, global sectors,
mma.sync steps, registers and spills from ptxas, occupancy; the flash kernels conflict-free, and planted
conflicts and spills caught."""

import dataclasses

import numpy as np
import pytest
from markers import needs_cxx, needs_nvrtc, nvdisasm_or_skip

from minitensor.backends import cuda
from minitensor.backends.kernels import attention
from minitensor.checks import counts, emulation, traffic


def planted(body, k=0):
    """A RawKernel of one 32-thread warp whose body is `body`, counted (x and y of 1024 floats, the int k;
    one build serves every k)."""
    spec = cuda.RawSpec("planted", inline=f'extern "C" __global__ void planted(const T *x, T *y, const int k) {{\n'
                                           f"  __shared__ __align__(16) T s[2048];\n"
                                           f"  const int lane = threadIdx.x & 31;\n{body}\n}}\n")
    x, y = np.arange(1024, dtype=np.float32), np.zeros(1024, np.float32)
    return traffic.count_launch(spec, np.float32, (1,), (32,), (x, y, np.int32(k)))


def shared_store(c):
    [site] = [s for s in c.shared() if s.write]
    return site


@needs_cxx
@pytest.mark.parametrize("stride, degree", [(1, 1), (33, 1), (2, 2), (8, 8), (32, 32)])
def test_a_strided_32_bit_store_costs_its_conflict_degree(stride, degree):
    """Lane l stores word l * stride: the lanes sharing a bank are gcd(stride, 32) apart in words."""
    c = planted("s[lane * k] = x[lane];", stride)
    site = shared_store(c)
    assert (site.requests, site.wavefronts, site.ideal, site.worst) == (1, degree, 1, degree)


@needs_cxx
def test_a_planted_8_way_conflict_counts_8_and_its_padding_1():
    """Lanes 4 g + t at row g, column t of a tile whose rows are 32 words apart (as the flash tiles were,
    with rows of 32 or 64 floats): 8 rows in one bank each column; rows 36 words apart spread them."""
    for row, degree in ((32, 8), (64, 8), (36, 1), (68, 1)):
        c = planted("s[(lane >> 2) * k + (lane & 3)] = x[lane];", row)
        assert shared_store(c).worst == degree and c.wavefronts == degree, row


@needs_cxx
def test_lanes_reading_one_word_share_it():
    """Every lane the same word: one wavefront; two words in one bank: two."""
    c = planted("y[lane] = s[k + 5] + s[(lane & 1) * 64];")
    assert sorted(s.wavefronts for s in c.shared()) == [1, 2]


@needs_cxx
@pytest.mark.parametrize("width, lanes_per_phase", [(8, 16), (16, 8)])
def test_wide_accesses_are_served_in_phases(width, lanes_per_phase):
    """A 64-bit access in half-warps, a 128-bit one in quarter-warps: contiguous lanes cost exactly the
    phases (no conflict); lanes a phase apart landing in the same banks do not conflict; within a phase
    they do."""
    kind, per = {8: "float2", 16: "float4"}[width], width // 4
    body = (f"const int at[3] = {{lane * {per}, (lane % {lanes_per_phase}) * {per}, "
            f"(lane & ~1) * {per} + (lane & 1) * 32}};\n"
            f"*({kind} *)(s + at[k]) = *({kind} *)(x + lane * {per});")
    phases = 32 // lanes_per_phase
    site = shared_store(planted(body, 0))  # contiguous lanes: one wavefront a phase
    assert (site.wavefronts, site.ideal, site.worst) == (phases, phases, 1)
    assert shared_store(planted(body, 1)).worst == 1  # every phase at the same 128 bytes
    site = shared_store(planted(body, 2))  # lanes 2i and 2i + 1 of a phase 128 bytes apart
    assert (site.wavefronts, site.worst) == (2 * phases, 2)


@needs_cxx
def test_global_requests_count_32_byte_sectors():
    c = planted("y[lane] = x[lane * k];", 8)  # a coalesced store, a read one float per sector
    sectors = {s.write: s.sectors for s in c.sites if s.memory == "global"}
    assert sectors == {True: 4, False: 32}


@needs_cxx
def test_mma_steps_and_special_functions_are_counted():
    c = planted("""unsigned a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
  float acc[4] = {0, 0, 0, 0};
  for (int i = 0; i < 3; ++i) mma_tf32(acc, a, b);
  y[lane] = expf(x[lane]) + logf(1.0f + x[lane]);""")
    assert (c.mma, c.sfu) == (3, 64)


@needs_cxx
def test_warps_wait_at_their_own_steps_while_others_wait_at_the_block_barrier():
    """Warp 0 shuffles while warp 1 already waits at __syncthreads: the emulation lets warp 0 finish
    its warp-level steps, as a GPU does; a warp split between a warp step and the block barrier is
    reported, not left to hang."""
    spec = cuda.RawSpec("warps", inline=r"""
extern "C" __global__ void warps(T *y) {
  T v = threadIdx.x;
  if (threadIdx.x < 32)
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  y[threadIdx.x] = v;
}""")
    y = np.zeros(64, np.float32)
    emulation.emulate_launch(spec, np.float32, (1,), (64,), (y,))
    assert y[:32].tolist() == [sum(range(32))] * 32 and y[32:].tolist() == list(range(32, 64))
    split = cuda.RawSpec("split", inline=r"""
extern "C" __global__ void split(T *y) {
  if (threadIdx.x < 16) y[0] = __shfl_xor_sync(0xffffffffu, y[0], 1);
  __syncthreads();
}""")
    with pytest.raises(RuntimeError, match="different barriers"):
        emulation.emulate_launch(split, np.float32, (1,), (32,), (np.zeros(1, np.float32),))


def flash_counts(T, heads=1, hs=64, blocks=None, source=None):
    """Counts of the three flash kernels on (heads, T, hs) (each launch's count_blocks unless `blocks`
    is 'all'), from the registered source or `source` (a planted change)."""
    rng = np.random.default_rng(0)
    q, k, v, dy = (rng.standard_normal((heads, T, hs)).astype(np.float32) for _ in range(4))
    with counts.captured_launches() as launches:
        y, lse = attention.flash_attention_forward_gpu(q, k, v, hs ** -0.5)
        attention.flash_attention_backward_gpu(q, k, v, y, dy, lse, hs ** -0.5)
    out = {}
    for spec, dtype, grid, block, args in launches:
        if source is not None:
            spec = dataclasses.replace(spec, inline=source(spec.code))  # the same template, its instances
        chosen = ([(b, 1) for b in range(int(np.prod(grid)))] if blocks == "all"
                  else cuda.KERNELS[spec.name].count_blocks(grid, block, args))
        out[spec.name] = traffic.count_launch(spec, dtype, grid, block, args, chosen)
    return out


@needs_cxx
def test_the_flash_kernels_are_conflict_free_and_issue_their_declared_products():
    for name, c in flash_counts(256).items():
        assert c.worst == 1 and c.wavefronts == c.ideal, name
        spec = cuda.KERNELS[name]
        assert spec.conflicts == 1
        # every mma step the flops declaration prices is issued, no more
        qkv = np.zeros((1, 256, 3, 1, 64), np.float32)  # one head's q, k, v as the kernels read them
        assert c.mma * 2048 == spec.flops(qkv=qkv, n_ctx=256, hs=64), name


@needs_cxx
def test_a_flash_tile_without_its_padding_is_caught():
    """Rows of 64 floats (the old layout): the fragment reads of a tile fall 8 to a bank."""
    planted_source = lambda code: code.replace("constexpr int LD = HS_MAX + 4;", "constexpr int LD = HS_MAX;")  # noqa: E731
    for name, c in flash_counts(128, source=planted_source).items():
        assert c.worst >= 8, name


@needs_cxx
def test_blocks_that_stand_for_others_count_what_every_block_counts():
    """At T = 384 (3 to 6 blocks a head), the two blocks the flash kernels' count_blocks choose, weighted,
    count exactly what all blocks of every head count (heads of 16)."""
    chosen, every = flash_counts(384, heads=2, hs=16), flash_counts(384, heads=2, hs=16, blocks="all")
    for name in every:
        a, b = chosen[name], every[name]
        assert (a.mma, a.sfu, a.wavefronts, a.sectors, a.shared_requests) == pytest.approx(
            (b.mma, b.sfu, b.wavefronts, b.sectors, b.shared_requests)), name


def test_occupancy_follows_the_calculators_rules():
    assert counts._occupancy(158, 256, 34816).blocks == 1            # 5120 registers a warp x 8 > 65536 / 2
    assert counts._occupancy(168, 128, 34816) == counts.Occupancy(3, 12, "registers")
    assert counts._occupancy(32, 256, 0) == counts.Occupancy(8, 64, "registers")
    assert counts._occupancy(16, 64, 0) == counts.Occupancy(32, 64, "warps")  # 32 blocks of 2 warps
    assert counts._occupancy(16, 64, 100 * 1024).limiter == "shared memory"


def test_problems_name_a_spill_and_a_conflict_over_the_declaration():
    res = counts.Resources(registers=255, stack=64, spill_stores=40, spill_loads=48, shared=0)
    site = traffic.Site("s[i] = v;", "shared", 4, True, 1, 8, 1, 8, 0)
    row = counts.KernelCounts("k", "raw", res, 128, counts._occupancy(255, 128, 0), 1,
                              traffic.Counts([site], 0, 0, 1), 1)
    found = counts.problems([row])
    assert len(found) == 2 and "spills 40 bytes" in found[0] and "8-way conflicted" in found[1]
    assert "s[i] = v;" in found[1]


@needs_nvrtc
def test_ptxas_reports_registers_and_a_forced_spill():
    res = counts.resources(attention.FLASH_FWD)
    assert 64 < res.registers <= 255 and res.spill_stores == 0 and res.shared == 2 * 64 * 68 * 4
    ln = cuda.KERNELS["layernorm_bwd"]  # its rows' values in registers: squeezed, they spill
    squeezed = cuda.RawSpec(ln.name, inline=ln.code, options=("--maxrregcount=24",))
    assert counts.resources(ln).spill_stores == 0 and counts.resources(squeezed).spill_stores > 0


@needs_nvrtc
def test_counts_command_prints_every_kernel_asked(capsys):
    from minitensor.checks.__main__ import main

    nvdisasm_or_skip()  # the command reads each kernel's SASS too

    assert main(["--counts", "layernorm_fwd", "gelu_fwd"]) == 0
    out = capsys.readouterr().out
    assert "layernorm_fwd" in out and "gelu_fwd" in out and "no request more conflicted than declared" in out
    with pytest.raises(SystemExit) as exit_:
        main(["--counts", "nope"])
    assert exit_.value.code == 2
