// Paged attention over the KV cache and the write of new keys/values into it.
//
// The KV cache is one tensor [num_pages, 2, num_layers, page_size, kv_heads, head_dim].
// Attention reads keys and values where they lie in their pages (no gather,
// no padding): each (query token, kv head) pair walks its sequence's pages
// with an online softmax, for the group of query heads sharing that kv head.
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
void write_kv_impl(const at::Tensor& k_new, const at::Tensor& v_new, at::Tensor& cache,
                   int64_t layer, const at::Tensor& slot_page, const at::Tensor& slot_offset) {
  const int64_t T = k_new.size(0), KVH = k_new.size(1), D = k_new.size(2);
  const int64_t L = cache.size(2), P = cache.size(3);
  const int64_t slot_stride = KVH * D, layer_stride = P * slot_stride, kv_stride = L * layer_stride,
                page_stride = 2 * kv_stride;
  auto* c = cache.data_ptr<scalar_t>();
  const int32_t* pg = slot_page.data_ptr<int32_t>();
  const int32_t* off = slot_offset.data_ptr<int32_t>();
  const int64_t ks0 = k_new.stride(0), ks1 = k_new.stride(1), vs0 = v_new.stride(0), vs1 = v_new.stride(1);
  const scalar_t* kp = k_new.data_ptr<scalar_t>();
  const scalar_t* vp = v_new.data_ptr<scalar_t>();
  for (int64_t t = 0; t < T; ++t) {
    scalar_t* kdst = c + pg[t] * page_stride + layer * layer_stride + off[t] * slot_stride;
    scalar_t* vdst = kdst + kv_stride;
    for (int64_t h = 0; h < KVH; ++h) {
      const scalar_t* ks = kp + t * ks0 + h * ks1;
      const scalar_t* vs = vp + t * vs0 + h * vs1;
      for (int64_t d = 0; d < D; ++d) {
        kdst[h * D + d] = ks[d];
        vdst[h * D + d] = vs[d];
      }
    }
  }
}

#ifdef __AVX512F__
// One block of up to 16 keys for S query heads sharing a kv head, head_dim
// 16 * DV, fp32. The S heads' output accumulators stay in registers for the
// whole block (S * DV independent FMA chains per value row): accumulating
// through memory instead chains every key's update on a store-to-load
// round trip, which was most of the decode attention time.
template <int DV, int S>
inline void attend_block(const float* q, float* acc, float* m, float* l, const float* krows,
                         const float* vrows, int64_t row_stride, int nk) {
  alignas(64) float p[S][16];
  __m512 av[S][DV];
  const __mmask16 valid = static_cast<__mmask16>((1u << nk) - 1);
  for (int h = 0; h < S; ++h) {
    __m512 qv[DV], part[16];
    for (int d = 0; d < DV; ++d) qv[d] = _mm512_loadu_ps(q + h * DV * 16 + d * 16);
    for (int j = 0; j < 16; ++j) {
      part[j] = _mm512_setzero_ps();
      if (j < nk)
        for (int d = 0; d < DV; ++d)
          part[j] = _mm512_fmadd_ps(qv[d], _mm512_loadu_ps(krows + j * row_stride + d * 16), part[j]);
    }
    const __m512 scores = reduce16(part);
    const float block_max = _mm512_mask_reduce_max_ps(valid, scores);
    const float new_max = std::max(m[h], block_max);
    const float correction = std::exp(m[h] - new_max);
    const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(scores, _mm512_set1_ps(new_max))));
    _mm512_store_ps(p[h], e);
    l[h] = l[h] * correction + _mm512_reduce_add_ps(e);
    m[h] = new_max;
    const __m512 c = _mm512_set1_ps(correction);
    for (int d = 0; d < DV; ++d) av[h][d] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * DV * 16 + d * 16), c);
  }
  for (int j = 0; j < nk; ++j) {
    __m512 vv[DV];
    for (int d = 0; d < DV; ++d) vv[d] = _mm512_loadu_ps(vrows + j * row_stride + d * 16);
    for (int h = 0; h < S; ++h) {
      const __m512 w = _mm512_set1_ps(p[h][j]);
      for (int d = 0; d < DV; ++d) av[h][d] = _mm512_fmadd_ps(w, vv[d], av[h][d]);
    }
  }
  for (int h = 0; h < S; ++h)
    for (int d = 0; d < DV; ++d) _mm512_storeu_ps(acc + h * DV * 16 + d * 16, av[h][d]);
}

// S heads at a time, as many as keep queries, accumulators and a value row
// within the 32 vector registers.
template <int DV>
inline void attend_group(const float* q, float* acc, float* m, float* l, const float* krows,
                         const float* vrows, int64_t row_stride, int nk, int64_t G) {
  constexpr int S = DV <= 4 ? 3 : 1;
  constexpr int64_t D = DV * 16;
  int64_t h = 0;
  for (; h + S <= G; h += S)
    attend_block<DV, S>(q + h * D, acc + h * D, m + h, l + h, krows, vrows, row_stride, nk);
  for (; h < G; ++h)
    attend_block<DV, 1>(q + h * D, acc + h * D, m + h, l + h, krows, vrows, row_stride, nk);
}
#endif

// The layer's geometry and inputs of one paged_attention call.
template <typename scalar_t>
struct AttentionArgs {
  int64_t H, D, KVH, G, P;
  int64_t slot_stride, layer_stride, kv_stride, page_stride;
  const scalar_t* cache;
  AttentionArgs(const at::Tensor& q, const at::Tensor& cache_t)
      : H(q.size(1)), D(q.size(2)), KVH(cache_t.size(4)), G(H / KVH), P(cache_t.size(3)),
        slot_stride(KVH * D), layer_stride(P * slot_stride), kv_stride(cache_t.size(2) * layer_stride),
        page_stride(2 * kv_stride), cache(cache_t.data_ptr<scalar_t>()) {}
};

// Running state of one work item: its query heads (scaled), and per head the
// online-softmax max `m`, sum `l` and output accumulator `acc`.
struct ItemState {
  std::vector<float> qf, acc, m, l;
  explicit ItemState(int64_t heads, int64_t D) : qf(heads * D), acc(heads * D), m(heads), l(heads) {}
};

// The walk shared by both kernels: split the query tokens into items, walk
// each item's pages with a prefetch two pages ahead, and normalise the output.
// `make_page_fn()` is called once per thread and returns the per-page body,
// `page_fn(state, page_keys_ptr, page_keys, g0, heads_per_item)`, which folds
// one page's keys and values into `state` for kv heads [g0, g0 + heads_per_item).
template <typename scalar_t, typename MakePageFn>
void walk_pages(at::Tensor& out, const at::Tensor& q, const AttentionArgs<scalar_t>& a, int64_t layer,
                const at::Tensor& tokens, const at::Tensor& token_seq, const at::Tensor& token_ctx,
                const at::Tensor& lookup_table, double scale, MakePageFn make_page_fn) {
  const int64_t D = a.D, G = a.G, P = a.P;
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t table_stride = lookup_table.stride(0);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int32_t* tok = tokens.data_ptr<int32_t>();
  const int32_t* seq = token_seq.data_ptr<int32_t>();
  const int32_t* ctx = token_ctx.data_ptr<int32_t>();
  const int32_t* table = lookup_table.data_ptr<int32_t>();
  const scalar_t* layer_base = a.cache + layer * a.layer_stride;
  // With many tokens an item is one token and all its kv heads, so each page's
  // keys and values are read front to back; with few tokens, split by head too
  // so every thread has work.
  const int64_t n_tokens = tokens.size(0);
  const int64_t groups = n_tokens >= 4 * at::get_num_threads() ? 1 : a.KVH;
  const int64_t heads_per_item = a.KVH / groups;
  const float fscale = static_cast<float>(scale);
  const int64_t page_bytes = P * a.slot_stride * static_cast<int64_t>(sizeof(scalar_t));
  const int64_t value_bytes = a.kv_stride * static_cast<int64_t>(sizeof(scalar_t));

  at::parallel_for(0, n_tokens * groups, 1, [&](int64_t begin, int64_t end) {
    const int64_t HG = heads_per_item * G;  // query heads handled by one item
    ItemState st(HG, D);
    auto page_fn = make_page_fn();
    // The page `ahead` pages past page `pi` of `item`, running on into this
    // thread's next items, so prefetching does not stop at a sequence's end
    // (each item would otherwise start on two cold pages).
    auto page_ahead = [&](int64_t item, int64_t pi, int64_t ahead) -> const scalar_t* {
      for (; item < end; ++item, pi = 0) {
        const int64_t t = tok[item / groups];
        const int64_t n_pages = (ctx[t] + P - 1) / P;
        if (pi + ahead < n_pages) return layer_base + table[seq[t] * table_stride + pi + ahead] * a.page_stride;
        ahead -= n_pages - pi;
      }
      return nullptr;
    };
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = tok[item / groups], g0 = (item % groups) * heads_per_item;
      const int64_t n_keys = ctx[t];
      const int32_t* pages = table + seq[t] * table_stride;
      for (int64_t h = 0; h < HG; ++h) {
        const scalar_t* src = qp + t * qs0 + (g0 * G + h) * qs1;
        for (int64_t d = 0; d < D; ++d) st.qf[h * D + d] = to_f(src[d]) * fscale;
        st.m[h] = -std::numeric_limits<float>::infinity();
        st.l[h] = 0.f;
      }
      std::fill(st.acc.begin(), st.acc.end(), 0.f);
      for (int64_t start = 0; start < n_keys; start += P) {
        if (const scalar_t* next = page_ahead(item, start / P, 2)) {
          // Pages are scattered, so hardware prefetchers cannot see the next
          // one: fetch its keys and values into L2 (into L1 they would evict
          // the page being computed).
          const char* ahead = reinterpret_cast<const char*>(next);
          for (int64_t off = 0; off < page_bytes; off += 64) {
            __builtin_prefetch(ahead + off, 0, 2);
            __builtin_prefetch(ahead + value_bytes + off, 0, 2);
          }
        }
        page_fn(st, layer_base + pages[start / P] * a.page_stride, std::min<int64_t>(P, n_keys - start), g0,
                heads_per_item);
      }
      for (int64_t h = 0; h < HG; ++h) {
        scalar_t* dst = op + t * os0 + (g0 * G + h) * os1;
        const float inv = 1.f / st.l[h];
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(st.acc[h * D + d] * inv);
      }
    }
  });
}

// fp32 attention with head_dim 16 * DV (64 or 128): keys in blocks of 16 (see attend_block).
template <int DV>
void attention_f32(at::Tensor& out, const at::Tensor& q, const at::Tensor& cache, int64_t layer,
                   const at::Tensor& tokens, const at::Tensor& token_seq,
                   const at::Tensor& token_ctx, const at::Tensor& lookup_table, double scale) {
#ifdef __AVX512F__
  const AttentionArgs<float> a(q, cache);
  constexpr int64_t D = DV * 16;
  walk_pages<float>(out, q, a, layer, tokens, token_seq, token_ctx, lookup_table, scale, [&] {
    return [&](ItemState& st, const float* page_k, int64_t page_keys, int64_t g0, int64_t heads) {
      for (int64_t j0 = 0; j0 < page_keys; j0 += 16) {
        const int nk = static_cast<int>(std::min<int64_t>(16, page_keys - j0));
        for (int64_t hg = 0; hg < heads; ++hg) {
          const float* kb = page_k + j0 * a.slot_stride + (g0 + hg) * D;
          const int64_t h = hg * a.G;
          attend_group<DV>(st.qf.data() + h * D, st.acc.data() + h * D, st.m.data() + h, st.l.data() + h, kb,
                           kb + a.kv_stride, a.slot_stride, nk, a.G);
        }
      }
    };
  });
#else
  TORCH_CHECK(false, "attention_f32 needs AVX-512");
#endif
}

// Any dtype and head_dim: one key at a time; non-fp32 rows are staged as floats.
template <typename scalar_t>
void attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& cache, int64_t layer,
                    const at::Tensor& tokens, const at::Tensor& token_seq,
                    const at::Tensor& token_ctx, const at::Tensor& lookup_table, double scale) {
  const AttentionArgs<scalar_t> a(q, cache);
  const int64_t D = a.D, G = a.G, P = a.P;
  walk_pages<scalar_t>(out, q, a, layer, tokens, token_seq, token_ctx, lookup_table, scale, [&] {
    // Per-thread scratch, owned by the returned body.
    return [&, kblk = std::vector<float>(P * D), vblk = std::vector<float>(P * D),
            scores = std::vector<float>(P)](ItemState& st, const scalar_t* page_k, int64_t nk, int64_t g0,
                                            int64_t heads) mutable {
      for (int64_t hg = 0; hg < heads; ++hg) {
        const scalar_t* kb = page_k + (g0 + hg) * D;
        const scalar_t* vb = kb + a.kv_stride;
        // fp32 rows are read in place; other dtypes are staged as floats.
        const float* krows;
        const float* vrows;
        int64_t row_stride;
        if constexpr (std::is_same_v<scalar_t, float>) {
          krows = kb;
          vrows = vb;
          row_stride = a.slot_stride;
        } else {
          for (int64_t j = 0; j < nk; ++j)
            for (int64_t d = 0; d < D; ++d) {
              kblk[j * D + d] = to_f(kb[j * a.slot_stride + d]);
              vblk[j * D + d] = to_f(vb[j * a.slot_stride + d]);
            }
          krows = kblk.data();
          vrows = vblk.data();
          row_stride = D;
        }
        for (int64_t hq = 0; hq < G; ++hq) {
          const int64_t h = hg * G + hq;
          float* sh = scores.data();
          float blk_max = -std::numeric_limits<float>::infinity();
          for (int64_t j = 0; j < nk; ++j) {
            sh[j] = dot(st.qf.data() + h * D, krows + j * row_stride, D);
            blk_max = std::max(blk_max, sh[j]);
          }
          const float new_max = std::max(st.m[h], blk_max);
          const float correction = std::exp(st.m[h] - new_max);
          for (int64_t j = 0; j < nk; ++j) sh[j] -= new_max;
          exp_inplace(sh, nk);
          float* ah = st.acc.data() + h * D;
          float sum = 0.f;
          if (correction != 1.f)
            for (int64_t d = 0; d < D; ++d) ah[d] *= correction;
          for (int64_t j = 0; j < nk; ++j) {
            sum += sh[j];
            axpy(sh[j], vrows + j * row_stride, ah, D);
          }
          st.l[h] = st.l[h] * correction + sum;
          st.m[h] = new_max;
        }
      }
    };
  });
}

void check_index(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt && t.is_contiguous(), name, " must be contiguous int32");
}

}  // namespace

// Write this step's keys and values into their cache slots for `layer`.
void write_kv(at::Tensor k_new, at::Tensor v_new, at::Tensor cache, int64_t layer,
              at::Tensor slot_page, at::Tensor slot_offset) {
  TORCH_CHECK(cache.is_contiguous() && cache.dim() == 6, "cache must be a contiguous 6-D page tensor");
  TORCH_CHECK(k_new.stride(2) == 1 && v_new.stride(2) == 1, "k/v rows must be contiguous in head_dim");
  check_index(slot_page, "slot_page");
  check_index(slot_offset, "slot_offset");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, cache.scalar_type(), "write_kv", [&] {
    write_kv_impl<scalar_t>(k_new, v_new, cache, layer, slot_page, slot_offset);
  });
}

// Attention of the query tokens listed in `tokens` over their sequences' cached
// keys [0, token_ctx[t]); results go to out[t].
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor cache, int64_t layer,
                     at::Tensor tokens, at::Tensor token_seq, at::Tensor token_ctx,
                     at::Tensor lookup_table, double scale) {
  TORCH_CHECK(cache.is_contiguous() && cache.dim() == 6, "cache must be a contiguous 6-D page tensor");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q/out rows must be contiguous in head_dim");
  check_index(tokens, "tokens");
  check_index(token_seq, "token_seq");
  check_index(token_ctx, "token_ctx");
  check_index(lookup_table, "lookup_table");
#ifdef __AVX512F__
  if (cache.scalar_type() == at::kFloat && q.scalar_type() == at::kFloat &&
      (cache.size(5) == 64 || cache.size(5) == 128)) {
    if (cache.size(5) == 64)
      attention_f32<4>(out, q, cache, layer, tokens, token_seq, token_ctx, lookup_table, scale);
    else
      attention_f32<8>(out, q, cache, layer, tokens, token_seq, token_ctx, lookup_table, scale);
    return;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, cache.scalar_type(), "paged_attention", [&] {
    attention_impl<scalar_t>(out, q, cache, layer, tokens, token_seq, token_ctx, lookup_table, scale);
  });
}

}  // namespace stencild
