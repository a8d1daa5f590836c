// SIMD helpers shared by the CPU kernels (header-only, internal linkage).
#pragma once

#include <cmath>
#include <cstdint>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace stencild {

#ifdef __AVX512F__
// exp for 16 floats: 2^n * e^r with |r| <= ln2/2, degree-6 polynomial
// (relative error ~1e-7, well inside what softmax needs).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// sin(x)^2 for 16 floats: reduce x by multiples of pi (sin^2 has period pi, so
// the quadrant's sign does not matter) and evaluate an odd polynomial on
// [-pi/2, pi/2] (error ~1e-7 after reduction).
inline __m512 sin_sq16(__m512 x) {
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(0.318309886183790671f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - k*pi in two steps (Cody-Waite) to keep precision for larger |x|.
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(3.14159274101257324f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-8.74227800037248e-8f), r);
  const __m512 r2 = _mm512_mul_ps(r, r);
  __m512 p = _mm512_set1_ps(-2.50521083854417e-8f);
  p = _mm512_fmadd_ps(p, r2, _mm512_set1_ps(2.75573192239859e-6f));
  p = _mm512_fmadd_ps(p, r2, _mm512_set1_ps(-1.98412698412698e-4f));
  p = _mm512_fmadd_ps(p, r2, _mm512_set1_ps(8.33333333333333e-3f));
  p = _mm512_fmadd_ps(p, r2, _mm512_set1_ps(-1.66666666666667e-1f));
  p = _mm512_fmadd_ps(p, r2, _mm512_set1_ps(1.0f));
  const __m512 sn = _mm512_mul_ps(p, r);
  return _mm512_mul_ps(sn, sn);
}
#endif

// e^x over an array, vectorized where the CPU allows.
inline void exp_inplace(float* x, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, exp16(_mm512_loadu_ps(x + i)));
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(x + i, m, exp16(_mm512_maskz_loadu_ps(m, x + i)));
    return;
  }
#endif
  for (; i < n; ++i) x[i] = std::exp(x[i]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  s = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y += a * x
inline void axpy(float a, const float* x, float* y, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 va = _mm512_set1_ps(a);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] += a * x[i];
}


// Prefetch the line holding `p` into L2 (prefetcht1), leaving L1 to the data
// in use. Inline assembly, because GCC 12 deleted a loop nest holding only
// __builtin_prefetch calls as if it did nothing.
inline void prefetch_l2(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

#ifdef __AVX512F__
// Horizontal sums of 16 vectors at once: lane j of the result is the sum of
// v[j]'s lanes. A transpose-and-add tree, about 3 instructions per vector
// where a reduce per vector costs about 8.
inline __m512 reduce16(const __m512 v[16]) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit chunk: [a0+a2, b0+b2, a1+a3, b1+b3]
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per chunk: [A, B, C, D], the chunk's partial sums of 4 vectors
    const __m512d c = _mm512_castps_pd(w[2 * i]), d = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)), _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
  }
  // Sum the four chunks: chunk i of the result holds the totals of vectors 4i..4i+3.
  const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

}  // namespace stencild
