// Elementwise and row-wise kernels of the model: SiLU-and-multiply, the fused
// residual add + RMSNorm, rotary embedding in place, and SNAC's snake activation.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace stencild {
namespace {

template <typename scalar_t>
void silu_mul_row(const scalar_t* __restrict g, const scalar_t* __restrict u, scalar_t* __restrict o,
                  float* __restrict e, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  if constexpr (std::is_same_v<scalar_t, float>) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (; i + 16 <= n; i += 16) {
      const __m512 gv = _mm512_loadu_ps(g + i);
      const __m512 act = _mm512_div_ps(gv, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
      _mm512_storeu_ps(o + i, _mm512_mul_ps(act, _mm512_loadu_ps(u + i)));
    }
  }
#endif
  for (int64_t k = i; k < n; ++k) e[k] = -to_f(g[k]);
  exp_inplace(e + i, n - i);
  for (; i < n; ++i) {
    // Round silu(gate) to the model dtype before the product, as torch does.
    const scalar_t act = static_cast<scalar_t>(to_f(g[i]) / (1.f + e[i]));
    o[i] = static_cast<scalar_t>(to_f(act) * to_f(u[i]));
  }
}

template <typename scalar_t>
void silu_mul_impl(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t T = gate_up.size(0), I = out.size(1);
  const scalar_t* gp = gate_up.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t gs = gate_up.stride(0), os = out.stride(0);
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> e(I);
    for (int64_t t = begin; t < end; ++t) silu_mul_row(gp + t * gs, gp + t * gs + I, op + t * os, e.data(), I);
  });
}

// Snake activation of SNAC: y = x + sin(alpha * x)^2 / (alpha + 1e-9), per channel.
void snake_impl(const float* x, const float* alpha, float* y, int64_t B, int64_t C, int64_t T) {
  at::parallel_for(0, B * C, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bc = begin; bc < end; ++bc) {
      const float a = alpha[bc % C];
      const float inv = 1.f / (a + 1e-9f);
      const float* xr = x + bc * T;
      float* yr = y + bc * T;
      int64_t t = 0;
#ifdef __AVX512F__
      const __m512 va = _mm512_set1_ps(a), vinv = _mm512_set1_ps(inv);
      for (; t + 16 <= T; t += 16) {
        const __m512 xv = _mm512_loadu_ps(xr + t);
        _mm512_storeu_ps(yr + t, _mm512_fmadd_ps(vinv, sin_sq16(_mm512_mul_ps(va, xv)), xv));
      }
#endif
      for (; t < T; ++t) {
        const float sn = std::sin(a * xr[t]);
        yr[t] = xr[t] + inv * sn * sn;
      }
    }
  });
}

#ifdef __AVX512F__
// One fp32 row: residual += x and the sum of squares in one pass, 16 lanes at
// a time (the scalar loop's single accumulator chain cost ~15 us per 16-row
// decode call on the bench model, 61 calls a step).
inline void add_rms_norm_row_f32(float* x, float* r, const float* w, int64_t H, float eps) {
  __m512 ss = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= H; i += 16) {
    const __m512 sum = _mm512_add_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(r + i));
    _mm512_storeu_ps(r + i, sum);
    ss = _mm512_fmadd_ps(sum, sum, ss);
  }
  const __mmask16 tail = static_cast<__mmask16>((1u << (H - i)) - 1);
  if (i < H) {
    const __m512 sum = _mm512_add_ps(_mm512_maskz_loadu_ps(tail, x + i), _mm512_maskz_loadu_ps(tail, r + i));
    _mm512_mask_storeu_ps(r + i, tail, sum);
    ss = _mm512_fmadd_ps(sum, sum, ss);
  }
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(H) + eps));
  for (i = 0; i + 16 <= H; i += 16)
    _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(w + i), _mm512_mul_ps(_mm512_loadu_ps(r + i), inv)));
  if (i < H)
    _mm512_mask_storeu_ps(x + i, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, w + i),
                                                    _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, r + i), inv)));
}
#endif

template <typename scalar_t>
void add_rms_norm_impl(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  const int64_t T = x.size(0), H = x.size(1);
  scalar_t* xp = x.data_ptr<scalar_t>();
  scalar_t* rp = residual.data_ptr<scalar_t>();
  const scalar_t* wp = weight.data_ptr<scalar_t>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
#ifdef __AVX512F__
    if constexpr (std::is_same_v<scalar_t, float>) {
      for (int64_t t = begin; t < end; ++t)
        add_rms_norm_row_f32(xp + t * xs, rp + t * rs, wp, H, static_cast<float>(eps));
      return;
    }
#endif
    std::vector<float> h(H);
    for (int64_t t = begin; t < end; ++t) {
      scalar_t* xr = xp + t * xs;
      scalar_t* rr = rp + t * rs;
      float ss = 0.f;
      for (int64_t i = 0; i < H; ++i) {
        // The residual stream is stored in the model dtype, as transformers does.
        const scalar_t sum = static_cast<scalar_t>(to_f(xr[i]) + to_f(rr[i]));
        rr[i] = sum;
        h[i] = to_f(sum);
        ss += h[i] * h[i];
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
      for (int64_t i = 0; i < H; ++i)
        xr[i] = static_cast<scalar_t>(to_f(wp[i]) * to_f(static_cast<scalar_t>(h[i] * inv)));
    }
  });
}

// Rotate interleaved pairs (2i, 2i + 1) of every head of token t by the
// rotation of position pos[t]: table rows hold (cos, sin) pairs.
template <typename scalar_t>
void rotary_impl(at::Tensor& x, const float* table, int64_t table_stride, const int64_t* pos) {
  const int64_t T = x.size(0), heads = x.size(1), D = x.size(2);
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1);
  scalar_t* xp = x.data_ptr<scalar_t>();
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* rot = table + pos[t] * table_stride;
      for (int64_t h = 0; h < heads; ++h) {
        scalar_t* v = xp + t * xs0 + h * xs1;
        int64_t d = 0;
#ifdef __AVX512F__
        if constexpr (std::is_same_v<scalar_t, float>) {
          for (; d + 16 <= D; d += 16) {
            // Even lanes: re*cos - im*sin; odd lanes: im*cos + re*sin.
            const __m512 r = _mm512_loadu_ps(rot + d), xv = _mm512_loadu_ps(v + d);
            const __m512 swapped = _mm512_permute_ps(xv, 0xB1);  // (im, re) in each pair
            _mm512_storeu_ps(v + d, _mm512_fmaddsub_ps(xv, _mm512_moveldup_ps(r),
                                                      _mm512_mul_ps(swapped, _mm512_movehdup_ps(r))));
          }
        }
#endif
        for (; d < D; d += 2) {
          const float re = to_f(v[d]), im = to_f(v[d + 1]), c = rot[d], s = rot[d + 1];
          v[d] = static_cast<scalar_t>(re * c - im * s);
          v[d + 1] = static_cast<scalar_t>(re * s + im * c);
        }
      }
    }
  });
}

}  // namespace

// residual += x; x = rms_norm(residual) * weight  (both in place).
void add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && residual.stride(1) == 1, "x/residual must be 2-D rows");
  TORCH_CHECK(weight.is_contiguous(), "weight must be contiguous");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_impl<scalar_t>(x, residual, weight, eps);
  });
}

// x [T, heads, head_dim] (interleaved pairs) rotated in place by
// table[positions[t]], a [max_positions, head_dim] float table of (cos, sin) pairs.
void rotary_embedding(at::Tensor x, at::Tensor table, at::Tensor positions) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "x must be [T, heads, even head_dim] rows");
  TORCH_CHECK(table.scalar_type() == at::kFloat && table.dim() == 2 && table.is_contiguous() &&
                  table.size(1) == x.size(2),
              "table must be contiguous float [max_positions, head_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == x.size(0),
              "positions must be contiguous int64, one per token");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.numel(); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < table.size(0), "position ", pos[t], " outside the rotation table");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_embedding", [&] {
    rotary_impl<scalar_t>(x, table.data_ptr<float>(), table.stride(0), pos);
  });
}

// out = silu(gate_up[:, :I]) * gate_up[:, I:]
at::Tensor silu_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [T, 2I] with contiguous rows");
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_impl<scalar_t>(gate_up, out);
  });
  return out;
}

// Snake activation for x [B, C, T] (fp32) with per-channel alpha.
at::Tensor snake(at::Tensor x, at::Tensor alpha) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat, "x must be float32 [B, C, T]");
  auto xc = x.contiguous();
  auto ac = alpha.reshape({-1}).to(at::kFloat).contiguous();
  TORCH_CHECK(ac.numel() == x.size(1), "alpha must have one value per channel");
  auto y = at::empty_like(xc);
  snake_impl(xc.data_ptr<float>(), ac.data_ptr<float>(), y.data_ptr<float>(), x.size(0), x.size(1), x.size(2));
  return y;
}

}  // namespace stencild
