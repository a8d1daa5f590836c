// The grammar mask on CPU logits: every token whose bit is 0 becomes -inf.
//
// A JSON schema's mask is mostly whole words of 32 tokens that are all
// disallowed (0) or, inside a string, all allowed (-1): those are one store
// of -inf or nothing; only mixed words go bit by bit. Memory-bound, so a row
// costs about one pass over its logits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "kernels.h"

namespace stencild {
namespace {

void mask_row(float* __restrict logits, const int32_t* __restrict words, int64_t covered, int64_t vocab) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t whole = covered / 32;
  for (int64_t w = 0; w < whole; ++w) {
    const uint32_t word = static_cast<uint32_t>(words[w]);
    float* out = logits + w * 32;
    if (word == 0xFFFFFFFFu) continue;
    if (word == 0) {
      for (int j = 0; j < 32; ++j) out[j] = kNegInf;
      continue;
    }
    for (int j = 0; j < 32; ++j) out[j] = ((word >> j) & 1u) ? out[j] : kNegInf;
  }
  if (whole * 32 < covered) {  // the last word covers fewer than 32 tokens
    const uint32_t word = static_cast<uint32_t>(words[whole]);
    for (int64_t t = whole * 32; t < covered; ++t)
      if (!((word >> (t - whole * 32)) & 1u)) logits[t] = kNegInf;
  }
  for (int64_t t = covered; t < vocab; ++t) logits[t] = kNegInf;  // ids the bitmask does not cover
}

}  // namespace

// For each r in rows: logits[r, t] = -inf where bit t of bitmask[r] is 0
// (tokens past the bitmask's 32 x words are disallowed too).
void apply_token_bitmask(at::Tensor logits, at::Tensor bitmask, at::Tensor rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "logits must be float32 [B, V] with contiguous rows");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.stride(1) == 1,
              "bitmask must be int32 [B, W] with contiguous rows");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "rows must be contiguous int64");
  const int64_t n = rows.numel(), vocab = logits.size(1);
  const int64_t covered = std::min<int64_t>(vocab, bitmask.size(1) * 32);
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(r[i] >= 0 && r[i] < logits.size(0) && r[i] < bitmask.size(0), "row ", r[i], " out of range");
  float* lp = logits.data_ptr<float>();
  const int32_t* bp = bitmask.data_ptr<int32_t>();
  const int64_t ls = logits.stride(0), bs = bitmask.stride(0);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) mask_row(lp + r[i] * ls, bp + r[i] * bs, covered, vocab);
  });
}

}  // namespace stencild
