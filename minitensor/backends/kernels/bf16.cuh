// bfloat16 in a kernel, held as its 16 bits (`unsigned short`): the top half of a float32, so that
// widening is a shift and narrowing a rounding of the low 16 bits (minitensor/precision.py says why
// not cuda_bf16.h). A kernel's section takes it with #include "bf16.cuh", as rows.cuh.
//   widen(h)     the float a bfloat16 stands for, exactly
//   narrow_bf16(f)  f rounded to the nearest bfloat16, ties to even (as __float2bfloat16_rn and
//                ml_dtypes round); a NaN becomes the quiet NaN of its sign (0x7fc0 / 0xffc0,
//                ml_dtypes' bits), infinities stay infinite
//   to_stored<T>(v)  a summed value v (ACC) as the stored type T: narrow_bf16 for a bfloat16, v itself for
//                float and double; a row kernel writes p[i] = to_stored<T>(v)
//   store(p, v)  *p = to_stored(v) as an overload on the pointer (the agreed `store(T *p, ACC v)`); the
//                row kernels use to_stored<T>, with which float32's and float64's code compiles to the
//                same cubin as before the split (passing &p[i] moved registers in some kernels)
// Overloads for float and double make the same code read and write the stored type T whatever it is.
__device__ __forceinline__ float widen(unsigned short h) { return __uint_as_float(((unsigned int)h) << 16); }
__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ double widen(double v) { return v; }

__device__ __forceinline__ unsigned short narrow_bf16(float f) {
  const unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)(((u >> 16) & 0x8000u) | 0x7fc0u);  // NaN
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);                   // to nearest, ties to even
}

template <class S> __device__ __forceinline__ S to_stored(float v) { return v; }
template <class S> __device__ __forceinline__ S to_stored(double v) { return v; }
template <> __device__ __forceinline__ unsigned short to_stored<unsigned short>(float v) { return narrow_bf16(v); }

__device__ __forceinline__ void store(unsigned short *p, float v) { *p = narrow_bf16(v); }
__device__ __forceinline__ void store(float *p, float v) { *p = v; }
__device__ __forceinline__ void store(double *p, double v) { *p = v; }
