// 16 fp32 lanes for the CPU kernels, in three forms chosen by the compile flags of the
// build (engine/cpu_build.py builds one library per instruction-set level):
//   __AVX512F__           one __m512
//   __AVX2__ && __FMA__   two __m256 (lo = lanes 0-7, hi = lanes 8-15)
//   otherwise             a plain float[16] the compiler may vectorise: no x86 intrinsic,
//                         so this form builds on any CPU (aarch64 included)
// Every form gives the same results up to the order of the horizontal sums.
// Header-only, internal linkage: each kernel source includes it inside its own anonymous
// namespace.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace tandem_vec {
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#if defined(__AVX512F__)
struct V16 {
  __m512 v;
};
inline __mmask16 first(int n) { return static_cast<__mmask16>((1u << n) - 1u); }
inline V16 vzero() { return {_mm512_setzero_ps()}; }
inline V16 vset1(float x) { return {_mm512_set1_ps(x)}; }
inline V16 vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V16 vload(const c10::BFloat16* p) {
  // bf16 -> fp32 is the 16 bits shifted into the high half.
  __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16))};
}
inline void vstore(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 vadd(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 vsub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 vmul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V16 vmax(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline float vsum(V16 a) { return _mm512_reduce_add_ps(a.v); }
inline float vhmax(V16 a) { return _mm512_reduce_max_ps(a.v); }
// first n lanes from p, the rest `fill`
inline V16 vload_n(const float* p, int n, float fill) {
  return {_mm512_mask_loadu_ps(_mm512_set1_ps(fill), first(n), p)};
}
inline void vstore_n(float* p, int n, V16 a) { _mm512_mask_storeu_ps(p, first(n), a.v); }
inline V16 vkeep_n(V16 a, int n) { return {_mm512_maskz_mov_ps(first(n), a.v)}; }
inline V16 vmin(V16 a, V16 b) { return {_mm512_min_ps(a.v, b.v)}; }
inline V16 vfnmadd(V16 a, V16 b, V16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }  // c - a * b
inline V16 vround_int(V16 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline V16 vscale2(V16 p, V16 n) { return {_mm512_scalef_ps(p.v, n.v)}; }  // p * 2^n, rounded once
// round to bf16 (nearest even, NaN -> quiet NaN) and back: the value torch's bf16 ops store
inline __m512i bf16_bits(V16 a) {
  const __m512i u = _mm512_castps_si512(a.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}
inline void vstore(c10::BFloat16* p, V16 a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(a)));
}
inline V16 vround_bf16(V16 a) { return {_mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(a), 16))}; }
inline V16 vdiv(V16 a, V16 b) { return {_mm512_div_ps(a.v, b.v)}; }
#elif defined(__AVX2__) && defined(__FMA__)
struct V16 {
  __m256 lo, hi;
};
// all-ones in the 32-bit lanes i < n (n may be <= 0 or >= 8)
inline __m256i first8(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
template <typename F>
inline V16 vmap2(V16 a, V16 b, const F& f) { return {f(a.lo, b.lo), f(a.hi, b.hi)}; }
inline V16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 bf16x8(const c10::BFloat16* p) {  // bf16 -> fp32 is the 16 bits shifted into the high half
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
}
inline V16 vload(const c10::BFloat16* p) { return {bf16x8(p), bf16x8(p + 8)}; }
inline void vstore(float* p, V16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline V16 vadd(V16 a, V16 b) { return vmap2(a, b, [](__m256 x, __m256 y) { return _mm256_add_ps(x, y); }); }
inline V16 vsub(V16 a, V16 b) { return vmap2(a, b, [](__m256 x, __m256 y) { return _mm256_sub_ps(x, y); }); }
inline V16 vmul(V16 a, V16 b) { return vmap2(a, b, [](__m256 x, __m256 y) { return _mm256_mul_ps(x, y); }); }
inline V16 vdiv(V16 a, V16 b) { return vmap2(a, b, [](__m256 x, __m256 y) { return _mm256_div_ps(x, y); }); }
inline V16 vmax(V16 a, V16 b) { return vmap2(a, b, [](__m256 x, __m256 y) { return _mm256_max_ps(x, y); }); }
inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline float vsum(V16 a) {
  const __m256 s = _mm256_add_ps(a.lo, a.hi);
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
inline float vhmax(V16 a) {
  const __m256 s = _mm256_max_ps(a.lo, a.hi);
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
// first n lanes from p, the rest `fill` (masked loads never touch the masked-off lanes)
inline V16 vload_n(const float* p, int n, float fill) {
  const __m256i m0 = first8(n), m1 = first8(n - 8);
  const __m256 f = _mm256_set1_ps(fill);
  return {_mm256_blendv_ps(f, _mm256_maskload_ps(p, m0), _mm256_castsi256_ps(m0)),
          _mm256_blendv_ps(f, _mm256_maskload_ps(p + 8, m1), _mm256_castsi256_ps(m1))};
}
inline void vstore_n(float* p, int n, V16 a) {
  _mm256_maskstore_ps(p, first8(n), a.lo);
  _mm256_maskstore_ps(p + 8, first8(n - 8), a.hi);
}
inline V16 vkeep_n(V16 a, int n) {
  return {_mm256_and_ps(a.lo, _mm256_castsi256_ps(first8(n))), _mm256_and_ps(a.hi, _mm256_castsi256_ps(first8(n - 8)))};
}
inline V16 vmin(V16 a, V16 b) { return vmap2(a, b, [](__m256 x, __m256 y) { return _mm256_min_ps(x, y); }); }
inline V16 vfnmadd(V16 a, V16 b, V16 c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 vround_int(V16 a) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, kMode), _mm256_round_ps(a.hi, kMode)};
}
// p * 2^n for integral n, |n| <= 145 (vexp's range): two exact power-of-two factors
// 2^(n>>1) * 2^(n-(n>>1)), each a normal float, so the result rounds once, as AVX-512's
// scalef does, and over/underflows where it does.
inline __m256 scale2_8(__m256 p, __m256 n) {
  const __m256i ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}
inline V16 vscale2(V16 p, V16 n) { return {scale2_8(p.lo, n.lo), scale2_8(p.hi, n.hi)}; }
// round to bf16 (nearest even, NaN -> quiet NaN), as the 32-bit lanes' low halves
inline __m256i bf16_bits8(__m256 a) {
  const __m256i u = _mm256_castps_si256(a);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256 nan = _mm256_cmp_ps(a, a, _CMP_UNORD_Q);
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc0)), nan));
}
inline void vstore(c10::BFloat16* p, V16 a) {
  // packus works per 128-bit lane: (lo0-3, hi0-3, lo4-7, hi4-7); the permute restores lane order
  const __m256i packed = _mm256_packus_epi32(bf16_bits8(a.lo), bf16_bits8(a.hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
}
inline V16 vround_bf16(V16 a) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(a.lo), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(a.hi), 16))};
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// hint 3 = all cache levels (T0), 2 = L2 and below (T1)
inline void prefetch(const void* p, int hint) {
  if (hint == 3)
    _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
  else
    _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
}
// exp with Cephes' expf polynomial (~1 ulp on the reduced range), one definition for both
// SIMD forms: overflows to +inf above ~88.7 (as expf does: silu needs exp(-x) -> inf, i.e.
// silu(-100) = -0) and flushes to 0 below -100.
inline V16 vexp(V16 x) {
  const V16 xv = vmax(vmin(x, vset1(100.0f)), vset1(-100.0f));
  const V16 n = vround_int(vmul(xv, vset1(1.44269504088896341f)));
  V16 r = vfnmadd(n, vset1(0.693359375f), xv);  // x - n*ln2, in two parts
  r = vfnmadd(n, vset1(-2.12194440e-4f), r);
  V16 p = vset1(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = vfma(p, r, vset1(c));
  p = vfma(p, vmul(r, r), vadd(r, vset1(1.0f)));
  return vscale2(p, n);
}
#else
struct V16 {
  float v[16];
};
#define V16_MAP(expr)                          \
  V16 r;                                       \
  for (int i = 0; i < 16; ++i) r.v[i] = expr; \
  return r
inline V16 vzero() { V16_MAP(0.f); }
inline V16 vset1(float x) { V16_MAP(x); }
template <typename T>
inline V16 vload(const T* p) { V16_MAP(static_cast<float>(p[i])); }
inline void vstore(float* p, V16 a) { for (int i = 0; i < 16; ++i) p[i] = a.v[i]; }
inline V16 vadd(V16 a, V16 b) { V16_MAP(a.v[i] + b.v[i]); }
inline V16 vsub(V16 a, V16 b) { V16_MAP(a.v[i] - b.v[i]); }
inline V16 vmul(V16 a, V16 b) { V16_MAP(a.v[i] * b.v[i]); }
inline V16 vfma(V16 a, V16 b, V16 c) { V16_MAP(std::fma(a.v[i], b.v[i], c.v[i])); }
inline V16 vmax(V16 a, V16 b) { V16_MAP(std::max(a.v[i], b.v[i])); }
inline float vsum(V16 a) { float s = 0.f; for (int i = 0; i < 16; ++i) s += a.v[i]; return s; }
inline float vhmax(V16 a) { float s = a.v[0]; for (int i = 1; i < 16; ++i) s = std::max(s, a.v[i]); return s; }
inline V16 vload_n(const float* p, int n, float fill) { V16_MAP(i < n ? p[i] : fill); }
inline void vstore_n(float* p, int n, V16 a) { for (int i = 0; i < n; ++i) p[i] = a.v[i]; }
inline V16 vkeep_n(V16 a, int n) { V16_MAP(i < n ? a.v[i] : 0.f); }
inline V16 vexp(V16 x) { V16_MAP(std::exp(x.v[i])); }
inline void prefetch(const void* p, int hint) {
  if (hint == 3)
    __builtin_prefetch(p, 0, 3);
  else
    __builtin_prefetch(p, 0, 2);
}
inline void vstore(c10::BFloat16* p, V16 a) { for (int i = 0; i < 16; ++i) p[i] = c10::BFloat16(a.v[i]); }
inline V16 vround_bf16(V16 a) { V16_MAP(static_cast<float>(c10::BFloat16(a.v[i]))); }
inline V16 vdiv(V16 a, V16 b) { V16_MAP(a.v[i] / b.v[i]); }
#undef V16_MAP
#endif

// The value an op in dtype T stores: identity for fp32, bf16 rounding for bf16. Kernels
// that mirror a chain of torch bf16 ops round where each of those ops would.
template <typename T>
inline V16 vround(V16 a) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) return vround_bf16(a);
  return a;
}

}  // namespace tandem_vec
