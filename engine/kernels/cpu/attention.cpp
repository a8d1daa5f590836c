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

// The layer's geometry and inputs of one paged_attention call; `softcap` > 0
// caps every score s (q.k times the scale) as softcap * tanh(s / softcap) (Gemma 2).
template <typename scalar_t>
struct AttentionArgs {
  int64_t H, D, KVH, G, P;
  int64_t slot_stride, layer_stride, kv_stride, page_stride;
  const scalar_t* cache;
  float softcap;
  AttentionArgs(const at::Tensor& q, const at::Tensor& cache_t, double cap)
      : H(q.size(1)), D(q.size(2)), KVH(cache_t.size(4)), G(H / KVH), P(cache_t.size(3)),
        slot_stride(KVH * D), layer_stride(P * slot_stride), kv_stride(cache_t.size(2) * layer_stride),
        page_stride(2 * kv_stride), cache(cache_t.data_ptr<scalar_t>()), softcap(static_cast<float>(cap)) {}
};

// Scores s[0, n) capped in place as cap * tanh(s / cap); nothing when cap is 0.
inline void cap_scores(float* s, int64_t n, float cap) {
  if (cap <= 0.f) return;
  const float inv = 1.f / cap;
  for (int64_t i = 0; i < n; ++i) s[i] = cap * std::tanh(s[i] * inv);
}

// Running state of one work item: its query heads (scaled), and per head the
// online-softmax max `m`, sum `l` and output accumulator `acc`.
struct ItemState {
  std::vector<float> qf, acc, m, l;
  explicit ItemState(int64_t heads, int64_t D) : qf(heads * D), acc(heads * D), m(heads), l(heads) {}
};

// The rows of a page that an item will read two pages from now (its kv heads'
// slice of each key row, and the matching value rows), fetched into L2 in
// slices while the current page is computed. Pages are scattered, so hardware
// prefetchers cannot see the next one. Fetching a whole page in one burst at
// the start of the current one stalled the core on its miss buffers instead
// of computing: spreading the same fetches over the page's blocks took a
// decode step's attention from 7.1 to 5.4 ms (bench model, batch 16).
struct PagePrefetch {
  const char* keys = nullptr;  // first byte of the item's slice of key row 0, or null
  int64_t rows = 0, row_bytes = 0, row_stride = 0, value_offset = 0;

  // Slice `i` of `n`: rows [i * rows / n, (i + 1) * rows / n).
  void slice(int64_t i, int64_t n) const {
    if (keys == nullptr) return;
    for (int64_t r = i * rows / n; r < (i + 1) * rows / n; ++r) {
      // Every line the row's bytes touch, from the line holding its start.
      const char* k = keys + r * row_stride;
      const int64_t lead = static_cast<int64_t>(reinterpret_cast<uintptr_t>(k) & 63);
      for (int64_t off = -lead; off < row_bytes; off += 64) {
        prefetch_l2(k + off);
        prefetch_l2(k + value_offset + off);
      }
    }
  }
};

// The walk shared by both kernels: split the query tokens into items, walk
// each item's pages and normalise the output. `make_kernel(heads)` is called
// once per thread, with the kv heads of one item, and returns an object with
//   page(state, page_keys_ptr, page_keys, g0, heads, prefetch): fold one
//     page's keys and values into `state` for kv heads [g0, g0 + heads),
//     calling prefetch.slice(i, n) as it goes;
//   finish(state, g0, heads): fold in anything still held back.
template <typename scalar_t, typename MakeKernel>
void walk_pages(at::Tensor& out, const at::Tensor& q, const AttentionArgs<scalar_t>& a, int64_t layer,
                const at::Tensor& tokens, const at::Tensor& token_seq, const at::Tensor& token_ctx,
                const at::Tensor& lookup_table, double scale, int64_t window, MakeKernel make_kernel) {
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
  const int64_t elem = static_cast<int64_t>(sizeof(scalar_t));
  // A token's first visible key: 0, or with a sliding window the first of its last `window`.
  auto first_key = [&](int64_t t) { return window > 0 ? std::max<int64_t>(0, ctx[t] - window) : int64_t{0}; };

  at::parallel_for(0, n_tokens * groups, 1, [&](int64_t begin, int64_t end) {
    const int64_t HG = heads_per_item * G;  // query heads handled by one item
    ItemState st(HG, D);
    auto kernel = make_kernel(heads_per_item);
    // The page `ahead` pages past page `pi` of `item`, running on into this
    // thread's next items, so prefetching does not stop at a sequence's end
    // (each item would otherwise start on two cold pages).
    auto prefetch_ahead = [&](int64_t item, int64_t pi, int64_t ahead) {
      PagePrefetch pf;
      for (; item < end; ++item, pi = item < end ? first_key(tok[item / groups]) / P : 0) {
        const int64_t t = tok[item / groups];
        const int64_t n_pages = (ctx[t] + P - 1) / P;
        if (pi + ahead < n_pages) {
          const scalar_t* page = layer_base + table[seq[t] * table_stride + pi + ahead] * a.page_stride;
          pf.keys = reinterpret_cast<const char*>(page + (item % groups) * heads_per_item * D);
          pf.rows = std::min<int64_t>(P, ctx[t] - (pi + ahead) * P);
          pf.row_bytes = heads_per_item * D * elem;
          pf.row_stride = a.slot_stride * elem;
          pf.value_offset = a.kv_stride * elem;
          break;
        }
        ahead -= n_pages - pi;
      }
      return pf;
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
      // Page by page from the first visible key (mid-page when a window starts there).
      for (int64_t start = first_key(t); start < n_keys;) {
        const int64_t pi = start / P, in_page = start % P, rows = std::min<int64_t>(P - in_page, n_keys - start);
        kernel.page(st, layer_base + pages[pi] * a.page_stride + in_page * a.slot_stride, rows, g0,
                    heads_per_item, prefetch_ahead(item, pi, 2));
        start += rows;
      }
      kernel.finish(st, g0, heads_per_item);
      for (int64_t h = 0; h < HG; ++h) {
        scalar_t* dst = op + t * os0 + (g0 * G + h) * os1;
        const float inv = 1.f / st.l[h];
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(st.acc[h * D + d] * inv);
      }
    }
  });
}

#ifdef __AVX512F__
// Scores q.k of up to 16 keys (head_dim 16 * DV) into s[0, nk): one FMA chain
// per key, summed across lanes for all 16 keys at once by reduce16. FULL
// blocks (nk = 16, the common case) get a fully unrolled body; with a runtime
// key count the compiler keeps a loop that spills the partial sums.
template <int DV, bool FULL>
inline void block_scores(const float* q, const float* krows, int64_t row_stride, int nk, float* s) {
  __m512 qv[DV], part[16];
  for (int d = 0; d < DV; ++d) qv[d] = _mm512_loadu_ps(q + d * 16);
  for (int j = 0; j < 16; ++j) {
    part[j] = _mm512_setzero_ps();
    if (FULL || j < nk)
      for (int d = 0; d < DV; ++d)
        part[j] = _mm512_fmadd_ps(qv[d], _mm512_loadu_ps(krows + j * row_stride + d * 16), part[j]);
  }
  if (FULL)
    _mm512_storeu_ps(s, reduce16(part));
  else
    _mm512_mask_storeu_ps(s, static_cast<__mmask16>((1u << nk) - 1), reduce16(part));
}

// Online-softmax update of one head over n held scores: the scores become
// exp(s - new max), and the running max and sum move on. Returns the factor
// by which the head's accumulator must be scaled.
inline float softmax_update(float* s, int64_t n, float& m, float& l) {
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + i));
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
  if (i < n) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, s + i));
  const float new_max = std::max(m, _mm512_reduce_max_ps(mx));
  const __m512 shift = _mm512_set1_ps(new_max);
  __m512 sum = _mm512_setzero_ps();
  for (i = 0; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), shift));
    _mm512_storeu_ps(s + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (i < n) {
    const __m512 e = _mm512_maskz_mov_ps(tail, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + i), shift)));
    _mm512_mask_storeu_ps(s + i, tail, e);
    sum = _mm512_add_ps(sum, e);
  }
  const float correction = std::exp(m - new_max);  // 0 on the first update (m = -inf)
  l = l * correction + _mm512_reduce_add_ps(sum);
  m = new_max;
  return correction;
}

// A run of held keys: its value rows and how many.
struct HeldBlock {
  const float* values;
  int64_t keys;
};

// acc[h] = acc[h] * correction[h] + sum_j p[h][j] * v[j] for S heads sharing
// a kv head (head_dim 16 * DV), over the held blocks. The S * DV accumulators
// stay in registers for all the keys: accumulating through memory chains every
// key's update on a store-to-load round trip.
template <int DV, int S>
inline void weighted_values(const float* p, int64_t p_stride, const HeldBlock* blocks, int64_t n_blocks,
                            int64_t head_offset, int64_t row_stride, float* acc, const float* correction) {
  __m512 av[S][DV];
  for (int h = 0; h < S; ++h) {
    const __m512 c = _mm512_set1_ps(correction[h]);
    for (int d = 0; d < DV; ++d) av[h][d] = _mm512_mul_ps(_mm512_loadu_ps(acc + (h * DV + d) * 16), c);
  }
  int64_t n = 0;
  for (int64_t b = 0; b < n_blocks; ++b) {
    const float* vr = blocks[b].values + head_offset;
    for (int64_t j = 0; j < blocks[b].keys; ++j, ++n) {
      __m512 vv[DV];
      for (int d = 0; d < DV; ++d) vv[d] = _mm512_loadu_ps(vr + j * row_stride + d * 16);
      for (int h = 0; h < S; ++h) {
        const __m512 w = _mm512_set1_ps(p[h * p_stride + n]);
        for (int d = 0; d < DV; ++d) av[h][d] = _mm512_fmadd_ps(w, vv[d], av[h][d]);
      }
    }
  }
  for (int h = 0; h < S; ++h)
    for (int d = 0; d < DV; ++d) _mm512_storeu_ps(acc + (h * DV + d) * 16, av[h][d]);
}

// fp32, head_dim 16 * DV (64 or 128). Scores are computed block by block as
// pages arrive and held (up to `chunk` keys); the softmax and the weighted sum
// of values then run over the whole run of held keys. Updating the softmax
// per block of 16 instead put a serial chain (horizontal max, exp, rescale)
// between every block's scores and its values.
template <int DV>
struct F32Kernel {
  static constexpr int64_t D = DV * 16;
  static constexpr int MAX_S = DV <= 4 ? 4 : 2;  // heads whose accumulators fit in registers
  const AttentionArgs<float>& a;
  int64_t chunk;
  std::vector<float> scores;  // [query heads of an item][chunk]
  std::vector<HeldBlock> blocks;
  std::vector<float> correction;
  int64_t held = 0;

  F32Kernel(const AttentionArgs<float>& args, int64_t item_heads)
      : a(args),
        // Held keys' values must still be in L2 when the weighted sum reads
        // them: about 128 KiB of value rows, 16 to 512 keys.
        chunk(std::clamp<int64_t>((128 << 10) / (item_heads * D * 4) / 16 * 16, 16, 512)),
        scores(item_heads * args.G * chunk),
        correction(item_heads * args.G) {
    blocks.reserve(chunk);
  }

  void page(ItemState& st, const float* page_k, int64_t page_keys, int64_t g0, int64_t heads,
            const PagePrefetch& prefetch) {
    const int64_t steps = (page_keys + 15) / 16 * heads;
    int64_t step = 0;
    for (int64_t j0 = 0; j0 < page_keys; j0 += 16) {
      const int nk = static_cast<int>(std::min<int64_t>(16, page_keys - j0));
      if (held + nk > chunk) finish(st, g0, heads);
      for (int64_t hg = 0; hg < heads; ++hg) {
        prefetch.slice(step++, steps);
        const float* kb = page_k + j0 * a.slot_stride + (g0 + hg) * D;
        for (int64_t hq = 0; hq < a.G; ++hq) {
          const int64_t h = hg * a.G + hq;
          float* sh = scores.data() + h * chunk + held;
          if (nk == 16)
            block_scores<DV, true>(st.qf.data() + h * D, kb, a.slot_stride, nk, sh);
          else
            block_scores<DV, false>(st.qf.data() + h * D, kb, a.slot_stride, nk, sh);
        }
      }
      blocks.push_back({page_k + a.kv_stride + j0 * a.slot_stride + g0 * D, nk});
      held += nk;
    }
  }

  void finish(ItemState& st, int64_t /*g0*/, int64_t heads) {
    if (held == 0) return;
    const int64_t HG = heads * a.G;
    for (int64_t h = 0; h < HG; ++h) {
      cap_scores(scores.data() + h * chunk, held, a.softcap);
      correction[h] = softmax_update(scores.data() + h * chunk, held, st.m[h], st.l[h]);
    }
    for (int64_t hg = 0; hg < heads; ++hg) {
      for (int64_t h0 = 0; h0 < a.G;) {
        const int64_t h = hg * a.G + h0;
        const int s = static_cast<int>(std::min<int64_t>(MAX_S, a.G - h0));
        const float* p = scores.data() + h * chunk;
        float* acc = st.acc.data() + h * D;
        const int64_t n_blocks = static_cast<int64_t>(blocks.size());
        switch (s) {
#define CASE(S_)                                                                                          \
  case S_:                                                                                                \
    if constexpr (S_ <= MAX_S)                                                                            \
      weighted_values<DV, S_>(p, chunk, blocks.data(), n_blocks, hg * D, a.slot_stride, acc, &correction[h]); \
    break;
          CASE(1) CASE(2) CASE(3) CASE(4)
#undef CASE
        }
        h0 += s;
      }
    }
    blocks.clear();
    held = 0;
  }
};
#endif

// fp32 attention with head_dim 16 * DV (64 or 128): see F32Kernel.
template <int DV>
void attention_f32(at::Tensor& out, const at::Tensor& q, const at::Tensor& cache, int64_t layer,
                   const at::Tensor& tokens, const at::Tensor& token_seq,
                   const at::Tensor& token_ctx, const at::Tensor& lookup_table, double scale, int64_t window,
                   double softcap) {
#ifdef __AVX512F__
  const AttentionArgs<float> a(q, cache, softcap);
  walk_pages<float>(out, q, a, layer, tokens, token_seq, token_ctx, lookup_table, scale, window,
                    [&](int64_t item_heads) { return F32Kernel<DV>(a, item_heads); });
#else
  TORCH_CHECK(false, "attention_f32 needs AVX-512");
#endif
}

// Any dtype and head_dim: one key at a time, the softmax updated per page;
// non-fp32 rows are staged as floats.
template <typename scalar_t>
struct GenericKernel {
  const AttentionArgs<scalar_t>& a;
  std::vector<float> kblk, vblk, scores;

  explicit GenericKernel(const AttentionArgs<scalar_t>& args)
      : a(args), kblk(args.P * args.D), vblk(args.P * args.D), scores(args.P) {}

  void page(ItemState& st, const scalar_t* page_k, int64_t nk, int64_t g0, int64_t heads,
            const PagePrefetch& prefetch) {
    const int64_t D = a.D, G = a.G;
    for (int64_t hg = 0; hg < heads; ++hg) {
      prefetch.slice(hg, heads);
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
        for (int64_t j = 0; j < nk; ++j) sh[j] = dot(st.qf.data() + h * D, krows + j * row_stride, D);
        cap_scores(sh, nk, a.softcap);
        for (int64_t j = 0; j < nk; ++j) blk_max = std::max(blk_max, sh[j]);
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
  }

  void finish(ItemState&, int64_t, int64_t) {}
};

template <typename scalar_t>
void attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& cache, int64_t layer,
                    const at::Tensor& tokens, const at::Tensor& token_seq,
                    const at::Tensor& token_ctx, const at::Tensor& lookup_table, double scale, int64_t window,
                    double softcap) {
  const AttentionArgs<scalar_t> a(q, cache, softcap);
  walk_pages<scalar_t>(out, q, a, layer, tokens, token_seq, token_ctx, lookup_table, scale, window,
                       [&](int64_t) { return GenericKernel<scalar_t>(a); });
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
// keys [0, token_ctx[t]), or with a sliding `window` > 0 only the last `window`
// of them, scores capped by `softcap` > 0; results go to out[t].
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor cache, int64_t layer,
                     at::Tensor tokens, at::Tensor token_seq, at::Tensor token_ctx,
                     at::Tensor lookup_table, double scale, int64_t window, double softcap) {
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
      attention_f32<4>(out, q, cache, layer, tokens, token_seq, token_ctx, lookup_table, scale, window, softcap);
    else
      attention_f32<8>(out, q, cache, layer, tokens, token_seq, token_ctx, lookup_table, scale, window, softcap);
    return;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, cache.scalar_type(), "paged_attention", [&] {
    attention_impl<scalar_t>(out, q, cache, layer, tokens, token_seq, token_ctx, lookup_table, scale, window, softcap);
  });
}

}  // namespace stencild
