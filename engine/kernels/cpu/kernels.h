// Entry points of stencild's CPU kernels, bound to Python in ops.cpp.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

namespace stencild {

// Write this step's keys and values into their cache slots for `layer`.
void write_kv(at::Tensor k_new, at::Tensor v_new, at::Tensor cache, int64_t layer, at::Tensor slot_page,
              at::Tensor slot_offset);
// Attention of the query tokens listed in `tokens` over their sequences' cached
// keys [0, token_ctx[t]), or with a sliding `window` > 0 only the last `window`
// of them, scores capped by `softcap` > 0 (0: none); results go to out[t].
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor cache, int64_t layer, at::Tensor tokens,
                     at::Tensor token_seq, at::Tensor token_ctx, at::Tensor lookup_table, double scale,
                     int64_t window, double softcap);

// Weights [N, K] -> blocks [ceil(N/16), K, 16] (zero padded), into `out`.
void pack_small_gemm(at::Tensor weight, at::Tensor out);
// y = x @ W^T (+ bias) for 1 to 16 fp32 rows, W packed by pack_small_gemm.
at::Tensor small_gemm(at::Tensor x, at::Tensor blocked, int64_t N, c10::optional<at::Tensor> bias);

// residual += x; x = rms_norm(residual) * weight  (both in place).
void add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
// Rotate x [T, heads, head_dim] (interleaved pairs) in place by table[positions[t]] ((cos, sin) pairs).
void rotary_embedding(at::Tensor x, at::Tensor table, at::Tensor positions);
// out = silu(gate_up[:, :I]) * gate_up[:, I:]
at::Tensor silu_mul(at::Tensor gate_up);
// Snake activation for x [B, C, T] (fp32) with per-channel alpha.
at::Tensor snake(at::Tensor x, at::Tensor alpha);

// The grammar mask: logits[r, t] = -inf where bit t of bitmask[r] is 0, for r in rows.
void apply_token_bitmask(at::Tensor logits, at::Tensor bitmask, at::Tensor rows);

}  // namespace stencild
