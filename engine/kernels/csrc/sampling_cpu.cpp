// Sampling for CPU in one pass over the vocab (loaded by engine/cpu_kernels.py): the
// greedy argmax, and seeded Gumbel-max with optional top-k / top-p / min-p:
//
//   out[b] = argmax_v( scores[b, v] * inv_temp[b] + G(key_b, v) ),   G = -log(-log u)
//   key_b  = seed_b * 0x9E3779B1 + position_b * 0x85EBCA77             (mod 2^32)
//   u      = (hash(key_b ^ v * 0xC2B2AE3D) >> 9 + 0.5) / 2^23          in (0, 1)
//
// This is engine/sampler.py's _gumbel, hash for hash: the torch version does the
// 32-bit arithmetic in masked int64, ten full-vocab tensors per step (7 ms of a
// 15 ms tiny-model step at batch 64, vocab 8k). Here the hash is native uint32 and
// the logs are vectorised, so the noise equals the torch noise to within float
// rounding of the two logs (~1 ulp) and the argmax agrees except on exact ties.
// -inf scores never win. Ties keep the lowest index.
//
// Top-k / top-p / min-p come without sorting the vocab. With
// p_v = exp(s_v - max s) (so the top token has p = 1) each filter keeps {v : p_v >= t}:
//   min-p: t = min_p
//   top-k: t = the smallest T with #{w : p_w > T} < k
//   top-p: t = the smallest T with sum{p_w : p_w > T} <= top_p * sum p
// and the smallest such T is found by bisecting over the bits of positive floats (which
// order like the floats), one pass over the row per step. Token v survives all three
// iff p_v >= max(t); the top token always does. These are the sorted path's sets
// (sampler._filtered_logprobs) except where tied values straddle a cut.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include "ops_library.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "vec16.h"

namespace {

inline uint32_t mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  return x ^ (x >> 16);
}

inline float gumbel_scalar(uint32_t key, uint32_t v) {
  const uint32_t x = mix(key ^ (v * 0xC2B2AE3Du));
  const float u = (static_cast<float>(x >> 9) + 0.5f) * (1.0f / 8388608.0f);
  return -std::log(-std::log(u));
}

#if defined(__AVX512F__)
// log(x) for normal x > 0: x = m * 2^e with m in [0.75, 1.5), log m = 2 atanh(t), t = (m-1)/(m+1),
// |t| <= 0.2, so the odd series to t^11 is below float rounding.
inline __m512 vlog(__m512 x) {
  const __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_p75_1p5, _MM_MANT_SIGN_src);
  const __m512 e = _mm512_sub_ps(_mm512_getexp_ps(x), _mm512_getexp_ps(m));  // x = m * 2^e exactly
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(m, one), _mm512_add_ps(m, one));
  const __m512 t2 = _mm512_mul_ps(t, t);
  __m512 p = _mm512_set1_ps(1.0f / 11);
  p = _mm512_fmadd_ps(p, t2, _mm512_set1_ps(1.0f / 9));
  p = _mm512_fmadd_ps(p, t2, _mm512_set1_ps(1.0f / 7));
  p = _mm512_fmadd_ps(p, t2, _mm512_set1_ps(1.0f / 5));
  p = _mm512_fmadd_ps(p, t2, _mm512_set1_ps(1.0f / 3));
  p = _mm512_fmadd_ps(p, t2, one);
  const __m512 log_m = _mm512_mul_ps(_mm512_mul_ps(p, t), _mm512_set1_ps(2.0f));
  return _mm512_fmadd_ps(e, _mm512_set1_ps(0.693147180559945f), log_m);
}

inline __m512i vmix(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x85EBCA6Bu)));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 13));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0xC2B2AE35u)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}
#endif

#if defined(__AVX512F__)
// Lane l holds the best value it saw and its first index (-1: none beat -inf). Fold the
// 16 lanes into (best, best_i): the maximum, the lowest index on ties.
inline void fold_lanes(__m512 bv, __m512i bi, float& best, int64_t& best_i) {
  alignas(64) float lv[16];
  alignas(64) int32_t li[16];
  _mm512_store_ps(lv, bv);
  _mm512_store_si512(li, bi);
  for (int l = 0; l < 16; ++l)
    if (li[l] >= 0 && (lv[l] > best || (lv[l] == best && li[l] < best_i))) best = lv[l], best_i = li[l];
}
#endif

// Greedy: the first index of the row's maximum, as torch.argmax returns it (NaN never
// wins). torch's CPU argmax streams at ~3 GB/s, a tenth of a tiny-model decode step.
int64_t max_index(const float* s, int64_t V) {
  float best = tandem_vec::kNegInf;
  int64_t best_i = -1, v = 0;
#if defined(__AVX512F__)
  __m512 bv = _mm512_set1_ps(tandem_vec::kNegInf);
  __m512i bi = _mm512_set1_epi32(-1);
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; v + 16 <= V; v += 16, idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16))) {
    const __m512 x = _mm512_loadu_ps(s + v);
    const __mmask16 better = _mm512_cmp_ps_mask(x, bv, _CMP_GT_OQ);
    bv = _mm512_mask_mov_ps(bv, better, x);
    bi = _mm512_mask_mov_epi32(bi, better, idx);
  }
  fold_lanes(bv, bi, best, best_i);
#endif
  for (; v < V; ++v)
    if (s[v] > best) best = s[v], best_i = v;
  return best_i < 0 ? 0 : best_i;  // an all -inf row: index 0, as torch
}

// p == nullptr: every token competes; else only those with p[v] >= thr.
int64_t argmax_row(const float* s, int64_t V, float inv_t, uint32_t key, const float* p = nullptr,
                   float thr = 0.f) {
  float best = tandem_vec::kNegInf;
  int64_t best_i = -1;
  int64_t v = 0;
#if defined(__AVX512F__)
  // Lane l tracks the best of v = l, l + 16, ...; strict > keeps the earliest per lane.
  __m512 bv = _mm512_set1_ps(tandem_vec::kNegInf);
  __m512i bi = _mm512_set1_epi32(-1);
  const __m512i keyv = _mm512_set1_epi32(static_cast<int>(key));
  const __m512 invt = _mm512_set1_ps(inv_t);
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; v + 16 <= V; v += 16, idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16))) {
    const __m512i col = _mm512_mullo_epi32(idx, _mm512_set1_epi32(static_cast<int>(0xC2B2AE3Du)));
    const __m512i x = vmix(_mm512_xor_si512(keyv, col));
    const __m512 u = _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(x, 9)), _mm512_set1_ps(0.5f)),
                                   _mm512_set1_ps(1.0f / 8388608.0f));
    const __m512 g = _mm512_sub_ps(_mm512_setzero_ps(), vlog(_mm512_sub_ps(_mm512_setzero_ps(), vlog(u))));
    __m512 val = _mm512_fmadd_ps(_mm512_loadu_ps(s + v), invt, g);
    if (p != nullptr) {
      const __mmask16 keep = _mm512_cmp_ps_mask(_mm512_loadu_ps(p + v), _mm512_set1_ps(thr), _CMP_GE_OQ);
      val = _mm512_mask_mov_ps(_mm512_set1_ps(tandem_vec::kNegInf), keep, val);
    }
    const __mmask16 better = _mm512_cmp_ps_mask(val, bv, _CMP_GT_OQ);
    bv = _mm512_mask_mov_ps(bv, better, val);
    bi = _mm512_mask_mov_epi32(bi, better, idx);
  }
  fold_lanes(bv, bi, best, best_i);
#endif
  for (; v < V; ++v) {
    if (p != nullptr && !(p[v] >= thr)) continue;
    const float val = s[v] * inv_t + gumbel_scalar(key, static_cast<uint32_t>(v));
    if (val > best) best = val, best_i = v;
  }
  return best_i < 0 ? 0 : best_i;  // an all -inf row cannot come from the filters (top-1 survives)
}

// p[v] = exp(s[v] * inv_t - max); returns sum p (the top token's p is exactly 1).
double unnormalised_probs(const float* s, int64_t V, float inv_t, float* p) {
  float m = tandem_vec::kNegInf;
  for (int64_t v = 0; v < V; ++v) m = std::max(m, s[v] * inv_t);
  double z = 0.0;
  int64_t v = 0;
#if defined(__AVX512F__)
  for (; v + 16 <= V; v += 16) {
    const tandem_vec::V16 e = tandem_vec::vexp(
        {_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(s + v), _mm512_set1_ps(inv_t)), _mm512_set1_ps(m))});
    _mm512_storeu_ps(p + v, e.v);
    z += _mm512_reduce_add_ps(e.v);
  }
#endif
  for (; v < V; ++v) z += (p[v] = std::exp(s[v] * inv_t - m));
  return z;
}

// (sum, count) of p[v] > t, the sum in double: it is compared with top_p * z.
std::pair<double, int64_t> above(const float* p, int64_t V, float t) {
  double sum = 0.0;
  int64_t n = 0, v = 0;
#if defined(__AVX512F__)
  __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
  for (; v + 16 <= V; v += 16) {
    const __m512 x = _mm512_loadu_ps(p + v);
    const __mmask16 gt = _mm512_cmp_ps_mask(x, _mm512_set1_ps(t), _CMP_GT_OQ);
    const __m512 xm = _mm512_maskz_mov_ps(gt, x);
    a0 = _mm512_add_pd(a0, _mm512_cvtps_pd(_mm512_castps512_ps256(xm)));
    a1 = _mm512_add_pd(a1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(xm), 1))));
    n += __builtin_popcount(static_cast<unsigned>(gt));
  }
  sum = _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
#endif
  for (; v < V; ++v)
    if (p[v] > t) sum += p[v], ++n;
  return {sum, n};
}

// The smallest float T in [0, 1] with ok(T), for ok false below some point and true above;
// ok(1) holds for every filter (nothing exceeds the top token's p = 1).
template <typename F>
float smallest_ok(const F& ok) {
  uint32_t lo = 0, hi = 0x3F800000u;  // the bits of 0.0f and 1.0f
  while (lo < hi) {
    const uint32_t mid = lo + (hi - lo) / 2;
    float t;
    std::memcpy(&t, &mid, sizeof t);
    if (ok(t))
      hi = mid;
    else
      lo = mid + 1;
  }
  float t;
  std::memcpy(&t, &lo, sizeof t);
  return t;
}

// Checks shared by the ops: CPU float32 (batch, vocab) logits with contiguous rows.
void check_logits(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.stride(1) == 1, "logits must be CPU float32 (batch, vocab) with contiguous rows");
  TORCH_CHECK(logits.size(1) > 0 && logits.size(1) < (int64_t{1} << 31), "vocab size out of range");
}

at::Tensor greedy_argmax(const at::Tensor& logits) {
  check_logits(logits);
  const int64_t B = logits.size(0), V = logits.size(1), rs = logits.stride(0);
  at::Tensor out = at::empty({B}, logits.options().dtype(at::kLong));
  const float* s = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) o[b] = max_index(s + b * rs, V);
  });
  return out;
}

// Rows without a filter (top_k >= vocab, top_p >= 1, min_p <= 0) skip the probability pass.
at::Tensor gumbel_argmax(const at::Tensor& logits, const at::Tensor& inv_temp, const at::Tensor& top_k,
                         const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& seeds,
                         const at::Tensor& positions) {
  check_logits(logits);
  const int64_t B = logits.size(0), V = logits.size(1), rs = logits.stride(0);
  for (const at::Tensor* t : {&inv_temp, &top_k, &top_p, &min_p, &seeds, &positions})
    TORCH_CHECK(t->is_contiguous() && t->numel() == B, "per-row inputs must be contiguous (batch,)");
  TORCH_CHECK(inv_temp.scalar_type() == at::kFloat && top_p.scalar_type() == at::kFloat &&
                  min_p.scalar_type() == at::kFloat && top_k.scalar_type() == at::kLong &&
                  seeds.scalar_type() == at::kLong && positions.scalar_type() == at::kLong,
              "float32 inv_temp/top_p/min_p, int64 top_k/seeds/positions");
  at::Tensor out = at::empty({B}, logits.options().dtype(at::kLong));
  const float *s = logits.data_ptr<float>(), *it = inv_temp.data_ptr<float>();
  const float *tp = top_p.data_ptr<float>(), *mp = min_p.data_ptr<float>();
  const int64_t *tk = top_k.data_ptr<int64_t>(), *sd = seeds.data_ptr<int64_t>(), *ps = positions.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> p;  // a row's unnormalised probabilities, for filtered rows
    for (int64_t b = b0; b < b1; ++b) {
      const float* row = s + b * rs;
      // Low 32 bits of the int64 products: the masked int64 math of the torch version.
      const uint32_t key = static_cast<uint32_t>(sd[b]) * 0x9E3779B1u + static_cast<uint32_t>(ps[b]) * 0x85EBCA77u;
      if (tk[b] >= V && tp[b] >= 1.f && mp[b] <= 0.f) {
        o[b] = argmax_row(row, V, it[b], key);
        continue;
      }
      p.resize(static_cast<size_t>(V));
      const double z = unnormalised_probs(row, V, it[b], p.data());
      float thr = std::max(mp[b], 0.f);
      if (tk[b] < V) thr = std::max(thr, smallest_ok([&](float t) { return above(p.data(), V, t).second < tk[b]; }));
      if (tp[b] < 1.f) {
        const double mass = static_cast<double>(tp[b]) * z;
        thr = std::max(thr, smallest_ok([&](float t) { return above(p.data(), V, t).first <= mass; }));
      }
      o[b] = argmax_row(row, V, it[b], key, p.data(), thr);
    }
  });
  return out;
}

}  // namespace

TANDEM_LIBRARY_FRAGMENT(TANDEM_OPS, m) {
  m.def("greedy_argmax(Tensor logits) -> Tensor");
  m.def(
      "gumbel_argmax(Tensor logits, Tensor inv_temp, Tensor top_k, Tensor top_p, Tensor min_p, "
      "Tensor seeds, Tensor positions) -> Tensor");
}

TANDEM_LIBRARY_IMPL(TANDEM_OPS, CPU, m) {
  m.impl("greedy_argmax", &greedy_argmax);
  m.impl("gumbel_argmax", &gumbel_argmax);
}
