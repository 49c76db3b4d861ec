"""The bf16 flash attention kernels (attention.cu's *_bf16 sections, flash16.cuh) run on the CPU through the
emulation (minitensor/checks/emulation.py: mma.m16n8k16 bf16 in the PTX fragment layout) against a float64
reference, at a bound derived from what the kernels round; planted bugs caught; counted conflict-free.

The bound. Inputs are rounded to bfloat16 first (the reference takes the same values), so the kernels'
error comes from three places only, u = 2^-8 being bfloat16's unit roundoff (8 significant bits; round to
nearest: relative error <= u):
- P and dS rounded to bfloat16 for their products (FlashAttention-2): relative error <= u each;
- each output (y, dq, dk, dv) rounded once to bfloat16 when stored: <= u |out|;
- float32 arithmetic: scores and dP summed in float32 over at most 64 exact products (a product of two
  bfloat16 is exact in float), expf and logf, the sums over keys: GAMMA = 1e-4 relative of the terms
  summed (2^-24 x 64 x the scores' size of ~6 is 2.3e-5; the rest is smaller).
Carried through y = P v, dv = P^T dy, dS = P (dP - D), dq = scale dS k, dk = scale dS^T q, elementwise:
  |y~ - y|   <= (u + GAMMA) (P |v|) + u |y|
  |dv~ - dv| <= (u + GAMMA) (P^T |dy|) + u |dv|
  |dS~ - dS| <= u |dS| + P |D~ - D| + GAMMA P (|dP| + |D|),  D = rowsum(dy y), D~ from the stored y~:
                |D~ - D| <= |dy| . (the bound of y)
  |dq~ - dq| <= scale (|dS~ - dS| |k|) + u |dq|,  |dk~ - dk| <= scale (|dS~ - dS|^T |q|) + u |dk|
  |lse~ - lse| <= GAMMA (1 + |lse|)
A rounding toward zero instead of to nearest stays within that bound (its error is at most 2u, and
random), so a second check looks at its sign: round-to-nearest errors average out to nothing over
thousands of outputs; truncation pulls every output toward zero (the mean of err * sign(out) is about
-u/2 of the mean |out|).
"""

import dataclasses

import numpy as np
import pytest
from markers import needs_cxx, needs_nvrtc, nvdisasm_or_skip

from minitensor import precision
from minitensor.backends import cuda
from minitensor.backends.kernels import attention
from minitensor.checks import counts, emulation, sass, traffic

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = precision.bfloat16()
U = 2.0 ** -8   # bfloat16's unit roundoff
GAMMA = 1e-4    # float32 arithmetic, relative (the module's docstring)
KERNELS = (attention.FLASH16_FWD, attention.FLASH16_BWD_DQ, attention.FLASH16_BWD_DKV)


@pytest.fixture
def emulated(monkeypatch):
    if emulation.shutil.which("g++") is None:
        pytest.skip("no g++ for the emulation")
    monkeypatch.setattr(cuda, "launch", emulation.emulate_launch)


def f64(a):
    return np.asarray(a).astype(np.float64)


def inputs(shape, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(shape).astype(BF16) for _ in range(4))


def reference(q, k, v, dy):
    """float64 attention of the bfloat16 inputs (as float64 values) and the bound of each output (the
    module's docstring): {name: (want, bound)} for y, lse, dq, dk, dv."""
    q, k, v, dy = (f64(a) for a in (q, k, v, dy))
    T, hs = q.shape[1:]
    scale = hs ** -0.5
    s = np.where(np.tril(np.ones((T, T), bool)), scale * q @ k.transpose(0, 2, 1), -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    P = e / e.sum(-1, keepdims=True)
    lse = (m + np.log(e.sum(-1, keepdims=True)))[..., 0]
    y = P @ v
    dP = dy @ v.transpose(0, 2, 1)
    D = (dy * y).sum(-1, keepdims=True)
    dS = P * (dP - D)
    dq, dk, dv = scale * dS @ k, scale * dS.transpose(0, 2, 1) @ q, P.transpose(0, 2, 1) @ dy
    Pt = P.transpose(0, 2, 1)
    y_bound = (U + GAMMA) * (P @ np.abs(v)) + U * np.abs(y)
    dD = (np.abs(dy) * y_bound).sum(-1, keepdims=True)
    dS_bound = U * np.abs(dS) + P * dD + GAMMA * P * (np.abs(dP) + np.abs(D))
    return {"y": (y, y_bound), "lse": (lse, GAMMA * (1 + np.abs(lse))),
            "dq": (dq, scale * dS_bound @ np.abs(k) + U * np.abs(dq)),
            "dk": (dk, scale * dS_bound.transpose(0, 2, 1) @ np.abs(q) + U * np.abs(dk)),
            "dv": (dv, (U + GAMMA) * (Pt @ np.abs(dy)) + U * np.abs(dv))}


def run(q, k, v, dy):
    hs = q.shape[-1]
    y, lse = attention.flash_attention_forward_gpu(q, k, v, hs ** -0.5)
    dq, dk, dv = attention.flash_attention_backward_gpu(q, k, v, y, dy, lse, hs ** -0.5)
    return {"y": y, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def worst(got, ref):
    """{name: max over elements of |got - want| / bound} (<= 1 within the bound)"""
    return {n: float(np.max(np.abs(f64(got[n]) - want) / bound)) for n, (want, bound) in ref.items()}


def bias(got, ref):
    """{name: mean(err * sign(want)) / (u mean |want|)}: about 0 rounding to nearest, about -1/2 toward zero"""
    return {n: float(np.mean((f64(got[n]) - want) * np.sign(want)) / (U * np.mean(np.abs(want))))
            for n, (want, _) in ref.items() if n != "lse"}


@needs_cxx
@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 37, 16), (2, 64, 64), (1, 150, 64), (2, 100, 32)])
def test_the_bf16_kernels_meet_their_bound_against_float64(emulated, shape):
    """y, lse and the three gradients: T = 1, T not a multiple of any tile (37, 100, 150: the last key and
    query tiles partial, the diagonal inside a tile), a multiple of every tile (64); heads of 64 (the run's),
    32 and 16; several heads. bfloat16 outputs, lse float32."""
    q, k, v, dy = inputs(shape, seed=shape[1])
    got = run(q, k, v, dy)
    assert {n: a.dtype.name for n, a in got.items()} == {"y": "bfloat16", "lse": "float32", "dq": "bfloat16",
                                                         "dk": "bfloat16", "dv": "bfloat16"}
    ratios = worst(got, reference(q, k, v, dy))
    assert max(ratios.values()) <= 1.0, ratios


@needs_cxx
def test_the_bf16_kernels_round_to_nearest_and_their_error_is_bf16s(emulated):
    """The outputs' errors are bfloat16's (well above float32's: the rounding happens) and unbiased."""
    q, k, v, dy = inputs((2, 128, 64), seed=3)
    got, ref = run(q, k, v, dy), reference(q, k, v, dy)
    for name in ("y", "dq", "dk", "dv"):
        want, _ = ref[name]
        err = np.max(np.abs(f64(got[name]) - want)) / np.max(np.abs(want))
        assert 1e-4 < err < 4 * U, (name, err)
    assert all(abs(b) < 0.1 for b in bias(got, ref).values()), bias(got, ref)


def planted(monkeypatch, spec_name, old, new):
    """The registered bf16 kernel `spec_name` with `old` replaced by `new` in its source, put in its place."""
    name = {s.name: n for n, s in vars(attention).items() if isinstance(s, cuda.RawSpec)}[spec_name]
    spec = getattr(attention, name)
    assert spec.code.count(old) >= 1, old
    monkeypatch.setattr(attention, name, dataclasses.replace(spec, inline=spec.code.replace(old, new)))


PLANTS = {
    # a fragment index: a[1] (rows g + 8, columns 2t..) read from row g, columns 2t + 8.., as a[2]
    "fragment": ("flash_attention_fwd_bf16", "a[1] = *(const unsigned *)(s + (r0 + g + 8) * LD + c0 + 2 * t);",
                 "a[1] = *(const unsigned *)(s + (r0 + g) * LD + c0 + 2 * t + 8);"),
    # a fragment index of ldmatrix: the upper 16 lanes' rows at columns 0.. instead of 8.. (B of columns 8-15)
    "ldmatrix": ("flash_attention_bwd_dq_bf16", "ldsm_x4_trans(b, s + (r0 + (lane & 15)) * LD + c0 + 8 * (lane >> 4));",
                 "ldsm_x4_trans(b, s + (r0 + (lane & 15)) * LD + c0);"),
    # the rounding of P and dS (and the outputs) to bfloat16 by truncation: the low 16 bits dropped
    "rounding": ("flash_attention_bwd_dkv_bf16", "return (unsigned)narrow_bf16(lo) | (unsigned)narrow_bf16(hi) << 16;",
                 "return __float_as_uint(lo) >> 16 | (__float_as_uint(hi) & 0xffff0000u);"),
    # a swapped operand: dv += P^T q instead of P^T dy
    "operand": ("flash_attention_bwd_dkv_bf16", "acc_product<DKV_Q / 8, HS>(acc_v, pa, dys);",
                "acc_product<DKV_Q / 8, HS>(acc_v, pa, qs);"),
}


@needs_cxx
@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_planted_bug_is_caught(emulated, monkeypatch, plant):
    """Each planted bug breaks the bound (a wrong fragment, a swapped operand: errors of the outputs' own
    size) or the sign check (a rounding toward zero), in the outputs it touches."""
    planted(monkeypatch, *PLANTS[plant])
    q, k, v, dy = inputs((2, 128, 64), seed=3)
    got, ref = run(q, k, v, dy), reference(q, k, v, dy)
    ratios, biases = worst(got, ref), bias(got, ref)
    broken = {n for n, r in ratios.items() if r > 1.0} | {n for n, b in biases.items() if abs(b) >= 0.1}
    touched = {"fragment": {"y", "lse"}, "ldmatrix": {"dq"}, "rounding": {"dk", "dv"}, "operand": {"dv"}}[plant]
    assert touched <= broken, (ratios, biases)
    print(plant, {n: round(r, 2) for n, r in ratios.items()}, {n: round(b, 2) for n, b in biases.items()})


@needs_cxx
def test_the_emulated_bf16_mma_follows_the_ptx_fragment_layout():
    """The emulation's mma.m16n8k16 bf16 against A B + C in float64, each lane loading its fragments from
    memory in the PTX ISA's layout ("Matrix Fragments for mma.m16n8k16 with floating point type"): a wrong
    element in the layout would land in the wrong place of D. The products are exact, so only float32's
    sum of 16 terms differs."""
    spec = cuda.RawSpec("mma16_layout", template=("one",), bf16=True, instances=lambda dtype: ((1,),), inline=r"""
template <int ONE> __global__ void mma16_layout(const T *a, const T *b, ACC *c, const int one) {
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  const unsigned fa[4] = {a[g * 16 + 2 * t] | (unsigned)a[g * 16 + 2 * t + 1] << 16,
                          a[(g + 8) * 16 + 2 * t] | (unsigned)a[(g + 8) * 16 + 2 * t + 1] << 16,
                          a[g * 16 + 2 * t + 8] | (unsigned)a[g * 16 + 2 * t + 9] << 16,
                          a[(g + 8) * 16 + 2 * t + 8] | (unsigned)a[(g + 8) * 16 + 2 * t + 9] << 16};
  const unsigned fb[2] = {b[2 * t * 8 + g] | (unsigned)b[(2 * t + 1) * 8 + g] << 16,
                          b[(2 * t + 8) * 8 + g] | (unsigned)b[(2 * t + 9) * 8 + g] << 16};
  float d[4] = {c[g * 8 + 2 * t], c[g * 8 + 2 * t + 1], c[(g + 8) * 8 + 2 * t], c[(g + 8) * 8 + 2 * t + 1]};
  mma_bf16(d, fa, fb);
  __syncthreads();
  c[g * 8 + 2 * t] = d[0];
  c[g * 8 + 2 * t + 1] = d[1];
  c[(g + 8) * 8 + 2 * t] = d[2];
  c[(g + 8) * 8 + 2 * t + 1] = d[3];
}
""")
    if emulation.shutil.which("g++") is None:
        pytest.skip("no g++ for the emulation")
    rng = np.random.default_rng(13)
    a, b = rng.standard_normal((16, 16)).astype(BF16), rng.standard_normal((16, 8)).astype(BF16)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    got = c.copy()
    emulation.emulate_launch(spec, BF16, (1,), (32,), (a, b, got, np.int32(1)))
    want = f64(a) @ f64(b) + f64(c)
    assert np.max(np.abs(got - want)) <= 16 * 2.0 ** -24 * np.max(np.abs(f64(a)) @ np.abs(f64(b)) + np.abs(c))
    assert np.max(np.abs(got - want)) > 0 or np.array_equal(got, want)


@needs_cxx
def test_the_emulated_ldmatrix_trans_gives_the_b_operands_down_a_tiles_columns():
    """ldmatrix.x4.trans as flash16.cuh's b_cols calls it (lane l: row l % 16, columns 8 (l / 16)..) on a 16 x 16
    tile in shared memory: lane 4 g + t receives the mma.m16n8k16 B operands of the tile's columns 0-7 in
    r[0], r[1] and of 8-15 in r[2], r[3]: (B(2t, g), B(2t + 1, g)) and (B(2t + 8, g), B(2t + 9, g)), low half
    first (PTX ISA, "Warp-level matrix load instruction: ldmatrix", .trans)."""
    spec = cuda.RawSpec("ldsm_layout", template=("one",), bf16=True, instances=lambda dtype: ((1,),), inline=r"""
template <int ONE> __global__ void ldsm_layout(const T *tile, int *out, const int one) {
  __shared__ __align__(16) T s[16 * 16];
  const int lane = threadIdx.x;
  for (int i = lane; i < 256; i += 32) s[i] = tile[i];
  __syncthreads();
  unsigned r[4];
  emu_ldsm_x4_trans(r, s + (lane & 15) * 16 + 8 * (lane >> 4), nullptr);
  for (int i = 0; i < 4; ++i) out[4 * lane + i] = (int)r[i];
}
""")
    tile = np.arange(256, dtype=np.uint16).reshape(16, 16)  # distinct 16-bit values, as the kernel's T holds them
    out = np.zeros(128, np.int32)
    emulation.emulate_launch(spec, BF16, (1,), (32,), (tile.view(BF16), out, np.int32(1)))
    got = out.view(np.uint32).reshape(32, 4)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        want = [int(tile[k, n]) | int(tile[k + 1, n]) << 16 for n0 in (0, 8) for k, n in ((2 * t, n0 + g), (2 * t + 8, n0 + g))]
        assert got[lane].tolist() == want, lane


def bf16_counts(T, hs=64, source=None):
    """Counts of the three bf16 kernels on (1, T, hs) as their count_blocks choose, from the registered
    source or `source` (a planted change)."""
    q, k, v, dy = inputs((1, T, hs))
    with counts.captured_launches() as launches:
        y, lse = attention.flash_attention_forward_gpu(q, k, v, hs ** -0.5)
        attention.flash_attention_backward_gpu(q, k, v, y, dy, lse, hs ** -0.5)
    out = {}
    for spec, dtype, grid, block, args in launches:
        chosen = spec.count_blocks(grid, block, args)
        if source is not None:
            spec = dataclasses.replace(spec, inline=source(spec.code))
        out[spec.name] = traffic.count_launch(spec, dtype, grid, block, args, chosen)
    return out


@needs_cxx
def test_the_bf16_kernels_are_conflict_free_and_issue_their_declared_products():
    """Worst degree 1 for every shared-memory request (the 32-bit and the 16-bit fragment reads, the
    16-byte tile stores); every m16n8k16 step the flops declaration prices (16 x 8 x 16 x 2 = 4096 FLOPs
    each) is issued, no more."""
    found = bf16_counts(256)
    assert set(found) == {s.name for s in KERNELS}
    for name, c in found.items():
        assert c.worst == 1 and c.wavefronts == c.ideal, name
        qkv = np.zeros((1, 256, 3, 1, 64), BF16)  # one head's q, k, v as the kernels read them
        assert c.mma * 4096 == cuda.KERNELS[name].flops(qkv=qkv, n_ctx=256, hs=64), name


@needs_cxx
def test_a_bf16_tile_without_its_padding_is_caught():
    """Rows of 64 bfloat16 (32 words): the fragment reads of a tile fall 8 rows to a bank."""
    found = bf16_counts(128, source=lambda code: code.replace("constexpr int LD = HS_MAX + 8;",
                                                              "constexpr int LD = HS_MAX;"))
    for name, c in found.items():
        assert c.worst >= 4, name


@needs_nvrtc
def test_the_bf16_kernels_compile_without_spills_branches_in_their_mma_loop_and_reach_their_occupancy():
    """sm_90, the instance the run launches (heads of 64): ptxas's registers without spills, the SASS's
    HMMA.16816 bf16 loop free of branches and pipelined, the declared warps per SM."""
    nvdisasm_or_skip()
    for spec in KERNELS:
        res = counts.resources(spec, "bfloat16", instance=(64,))
        assert res.spill_stores == res.spill_loads == 0, spec.name
        code = sass.read(spec, (64,), "bfloat16")
        assert code.hmma and code.branches == 0 and code.pipelined, spec.name
        assert counts.occupancy_of(spec).warps >= spec.warps_per_sm > 0, spec.name


def test_the_wrappers_take_bf16_and_refuse_what_the_kernels_do_not():
    q = np.zeros((2, 8, 16), BF16)
    assert attention.flash_fits(64, BF16) and not attention.flash_fits(80, BF16)
    assert attention.flash16_instances(BF16) == ((16,), (32,), (48,), (64,))
    assert attention.flash16_instances(np.float32) == () and attention.flash_instances(BF16) == ()
    with pytest.raises(ValueError, match="head size 80"):
        attention.flash_attention_forward_gpu(*(np.zeros((2, 8, 80), BF16),) * 3, 1.0)
    with pytest.raises(ValueError, match="lse must hold 16 contiguous float32"):
        attention.flash_attention_forward_gpu(q, q, q, 1.0, lse=np.zeros((2, 8), BF16))
    with pytest.raises(ValueError, match="k must be"):
        attention.flash_attention_forward_gpu(q, q.astype(np.float32), q, 1.0)
    with counts.captured_launches() as launches:
        y, lse = attention.flash_attention_forward_gpu(q, q, q, 1.0)
        attention.flash_attention_backward_gpu(q, q, q, y, q, lse, 1.0)
    assert [spec.name for spec, *_ in launches] == [s.name for s in KERNELS]
    assert y.dtype == BF16 and lse.dtype == np.float32
    scales = [args[[name for name, *_ in cuda.raw_params(spec)].index("scale")] for spec, *_, args in launches]
    assert all(type(a) is np.float32 for a in scales)  # the scale is float32


@needs_cxx
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_bias_the_kernels_add_as_they_read_gives_the_bits_of_the_add_it_replaced(emulated, dtype):
    """c_attn's bias, added by the flash kernels as they read q, k and v where c_attn wrote them (the packed
    (B, T, 3, n_head, hs) array), gives the bits that adding it first gives (the add the kernels replaced:
    summed in float32, a bfloat16 sum rounded once) with the kernels then adding none: y, lse, and dq, dk,
    dv written into the packed gradient. float32 on TF32 tensor cores (its operands rounded after the add,
    as before). Two sequences of 2 heads of 16 over 40 positions (a partial tile); the bias does change the
    result (else the check would be empty)."""
    dt = BF16 if dtype == "bfloat16" else np.dtype(np.float32)
    B, T, nh, hs = 2, 40, 2, 16
    rng = np.random.default_rng(5)
    qkv = rng.standard_normal((B, T, 3, nh, hs)).astype(dt)
    b = rng.standard_normal(3 * nh * hs).astype(dt)
    dy = rng.standard_normal((B, T, nh, hs)).astype(dt)
    added = (qkv.astype(np.float32) + b.astype(np.float32).reshape(3, nh, hs)).astype(dt)

    def run(x, bias):
        y = np.empty((B, T, nh, hs), dt)
        lse = attention.flash_forward(x, bias, hs ** -0.5, y)
        return y, lse, attention.flash_backward(x, bias, y, dy, lse, hs ** -0.5)

    got, want = run(qkv, b), run(added, None)
    for name, g, w in zip(("y", "lse", "dqkv"), got, want, strict=True):
        assert g.dtype == w.dtype and g.tobytes() == w.tobytes(), name
    assert run(qkv, None)[0].tobytes() != want[0].tobytes()
