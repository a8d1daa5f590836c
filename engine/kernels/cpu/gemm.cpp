// Small-batch linear layer for decoding.
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

// ---------------------------------------------------------------------------
// Small-batch linear layer: y[M, N] = x[M, K] @ W^T (+ bias), M <= 16, fp32.
// W is stored in blocks of 16 output features, [N/16][K][16], so one vector
// load of weights feeds one FMA per input row (its element broadcast) and the
// weights stream from memory exactly once per call whatever M is: decoding is
// bound by that stream at small M and by FMAs near M = 16.
#ifdef __AVX512F__
template <int M>
void gemm_block(const float* __restrict xt, const float* __restrict wb, int64_t K,
                float* __restrict y, int64_t ldy, const float* bias, int64_t n_valid) {
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    // Two prefetch distances: 256 lines ahead into L2 covers DRAM latency
    // (16 lines was too short and left the FMAs waiting), 16 lines ahead
    // into L1 covers L2 latency. Past the block's end this runs into the
    // next block, which is what this thread computes next; a prefetch of an
    // address past the tensor cannot fault. Measured: 25 -> 20 ms of
    // linears per decode step at M = 16 on the bench model.
    _mm_prefetch(reinterpret_cast<const char*>(wb + (k + 256) * 16), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(wb + (k + 16) * 16), _MM_HINT_T0);
    const __m512 w = _mm512_loadu_ps(wb + k * 16);
    for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(xt[k * M + m]), w, acc[m]);
  }
  const __mmask16 mask = n_valid >= 16 ? static_cast<__mmask16>(0xFFFF)
                                       : static_cast<__mmask16>((1u << n_valid) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int m = 0; m < M; ++m) _mm512_mask_storeu_ps(y + m * ldy, mask, _mm512_add_ps(acc[m], b));
}

// x arrives as rows [M, K]; the kernel reads it transposed, [K, M], so the M
// inputs broadcast against one weight vector share a cache line instead of
// coming from M lines (20 -> 18 ms per decode step at M = 16).
template <int M>
void gemm_rows(const float* x, int64_t ldx, const float* wb, int64_t K, int64_t N, float* y, const float* bias) {
  std::vector<float> xt(K * M);
  for (int m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xt[k * M + m] = x[m * ldx + k];
  const int64_t blocks = (N + 15) / 16;
  at::parallel_for(0, blocks, 8, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb)
      gemm_block<M>(xt.data(), wb + nb * K * 16, K, y + nb * 16, N, bias ? bias + nb * 16 : nullptr,
                    std::min<int64_t>(16, N - nb * 16));
  });
}
#endif


}  // namespace

// Weights [N, K] -> blocks [ceil(N/16), K, 16] (zero padded), into `out`.
void pack_small_gemm(at::Tensor weight, at::Tensor out) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 2, "weight must be fp32 [N, K]");
  const auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), blocks = (N + 15) / 16;
  TORCH_CHECK(out.is_contiguous() && out.numel() == blocks * K * 16, "out must hold ceil(N/16) * K * 16 floats");
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb)
      for (int64_t k = 0; k < K; ++k)
        for (int64_t j = 0; j < 16; ++j) {
          const int64_t n = nb * 16 + j;
          dst[(nb * K + k) * 16 + j] = n < N ? src[n * K + k] : 0.f;
        }
  });
}

at::Tensor small_gemm(at::Tensor x, at::Tensor blocked, int64_t N, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, "x must be fp32 [M, K] rows");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(M >= 1 && M <= 16, "small_gemm takes 1 to 16 rows");
  TORCH_CHECK(blocked.numel() == (N + 15) / 16 * K * 16, "blocked weight does not match");
  auto y = at::empty({M, N}, x.options());
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
#ifdef __AVX512F__
  const float* xp = x.data_ptr<float>();
  const float* wb = blocked.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  switch (M) {
#define CASE(n) case n: gemm_rows<n>(xp, ldx, wb, K, N, yp, b); break;
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
    CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
#undef CASE
  }
#else
  TORCH_CHECK(false, "small_gemm needs AVX-512");
#endif
  return y;
}

}  // namespace stencild
