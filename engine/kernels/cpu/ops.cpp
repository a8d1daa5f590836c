// CPU kernels for stencild: paged attention for short queries and a fused
// residual-add + RMSNorm. Built on first use by engine/kernels/__init__.py.
//
// The KV cache is one tensor [num_pages, 2, num_layers, page_size, kv_heads, head_dim].
// Attention reads keys and values where they lie in their pages (no gather,
// no padding): each (query token, kv head) pair walks its sequence's pages
// with an online softmax, for the group of query heads sharing that kv head.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

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


template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

template <typename scalar_t>
void write_kv_impl(const torch::Tensor& k_new, const torch::Tensor& v_new, torch::Tensor& cache,
                   int64_t layer, const torch::Tensor& slot_page, const torch::Tensor& slot_offset) {
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
  AttentionArgs(const torch::Tensor& q, const torch::Tensor& cache_t)
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
void walk_pages(torch::Tensor& out, const torch::Tensor& q, const AttentionArgs<scalar_t>& a, int64_t layer,
                const torch::Tensor& tokens, const torch::Tensor& token_seq, const torch::Tensor& token_ctx,
                const torch::Tensor& lookup_table, double scale, MakePageFn make_page_fn) {
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
void attention_f32(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& cache, int64_t layer,
                   const torch::Tensor& tokens, const torch::Tensor& token_seq,
                   const torch::Tensor& token_ctx, const torch::Tensor& lookup_table, double scale) {
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
void attention_impl(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& cache, int64_t layer,
                    const torch::Tensor& tokens, const torch::Tensor& token_seq,
                    const torch::Tensor& token_ctx, const torch::Tensor& lookup_table, double scale) {
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
void silu_mul_impl(const torch::Tensor& gate_up, torch::Tensor& out) {
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

template <typename scalar_t>
void add_rms_norm_impl(torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight, double eps) {
  const int64_t T = x.size(0), H = x.size(1);
  scalar_t* xp = x.data_ptr<scalar_t>();
  scalar_t* rp = residual.data_ptr<scalar_t>();
  const scalar_t* wp = weight.data_ptr<scalar_t>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
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

void check_index(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kInt32 && t.is_contiguous(), name, " must be contiguous int32");
}

}  // namespace

// Write this step's keys and values into their cache slots for `layer`.
void write_kv(torch::Tensor k_new, torch::Tensor v_new, torch::Tensor cache, int64_t layer,
              torch::Tensor slot_page, torch::Tensor slot_offset) {
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
void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor cache, int64_t layer,
                     torch::Tensor tokens, torch::Tensor token_seq, torch::Tensor token_ctx,
                     torch::Tensor lookup_table, double scale) {
  TORCH_CHECK(cache.is_contiguous() && cache.dim() == 6, "cache must be a contiguous 6-D page tensor");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q/out rows must be contiguous in head_dim");
  check_index(tokens, "tokens");
  check_index(token_seq, "token_seq");
  check_index(token_ctx, "token_ctx");
  check_index(lookup_table, "lookup_table");
#ifdef __AVX512F__
  if (cache.scalar_type() == torch::kFloat32 && q.scalar_type() == torch::kFloat32 &&
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

// residual += x; x = rms_norm(residual) * weight  (both in place).
void add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && residual.stride(1) == 1, "x/residual must be 2-D rows");
  TORCH_CHECK(weight.is_contiguous(), "weight must be contiguous");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_impl<scalar_t>(x, residual, weight, eps);
  });
}


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

// Weights [N, K] -> blocks [ceil(N/16), K, 16] (zero padded), into `out`.
void pack_small_gemm(torch::Tensor weight, torch::Tensor out) {
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.dim() == 2, "weight must be fp32 [N, K]");
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

torch::Tensor small_gemm(torch::Tensor x, torch::Tensor blocked, int64_t N, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1, "x must be fp32 [M, K] rows");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(M >= 1 && M <= 16, "small_gemm takes 1 to 16 rows");
  TORCH_CHECK(blocked.numel() == (N + 15) / 16 * K * 16, "blocked weight does not match");
  auto y = torch::empty({M, N}, x.options());
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

// out = silu(gate_up[:, :I]) * gate_up[:, I:]
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [T, 2I] with contiguous rows");
  auto out = torch::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_impl<scalar_t>(gate_up, out);
  });
  return out;
}

// Snake activation for x [B, C, T] (fp32) with per-channel alpha.
torch::Tensor snake(torch::Tensor x, torch::Tensor alpha) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat32, "x must be float32 [B, C, T]");
  auto xc = x.contiguous();
  auto ac = alpha.reshape({-1}).to(torch::kFloat32).contiguous();
  TORCH_CHECK(ac.numel() == x.size(1), "alpha must have one value per channel");
  auto y = torch::empty_like(xc);
  snake_impl(xc.data_ptr<float>(), ac.data_ptr<float>(), y.data_ptr<float>(), x.size(0), x.size(1), x.size(2));
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Release the GIL so the engine's host thread runs while a forward pass computes.
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("silu_mul", &silu_mul, "silu(gate) * up for a fused gate|up projection", release());
  m.def("snake", &snake, "SNAC snake activation", release());
  m.def("pack_small_gemm", &pack_small_gemm, "weights into 16-feature blocks", release());
  m.def("small_gemm", &small_gemm, "linear layer for 1 to 16 rows", release());
  m.attr("has_avx512") = py::bool_(
#ifdef __AVX512F__
      true
#else
      false
#endif
  );
  m.def("write_kv", &write_kv, "write new keys/values into the paged cache", release());
  m.def("paged_attention", &paged_attention, "paged attention for short queries", release());
  m.def("add_rms_norm", &add_rms_norm, "fused residual add + RMSNorm, in place", release());
}
