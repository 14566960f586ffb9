// 16 fp32 lanes for the CPU kernels: AVX-512 when compiled for it (-march=native on a
// CPU that has it), else a plain array the compiler may vectorise. Header-only, internal
// linkage: each kernel source includes it inside its own anonymous namespace.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#if defined(__AVX512F__)
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
// exp with Cephes' expf polynomial (~1 ulp on the reduced range); overflows to +inf above ~88.7
// (as expf does: silu needs exp(-x) -> inf, i.e. silu(-100) = -0) and flushes to 0 below -100.
inline V16 vexp(V16 x) {
  __m512 xv = _mm512_max_ps(_mm512_min_ps(x.v, _mm512_set1_ps(100.0f)), _mm512_set1_ps(-100.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xv, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xv);  // x - n*ln2, in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return {_mm512_scalef_ps(p, n)};  // p * 2^n
}
// hint 3 = all cache levels (T0), 2 = L2 and below (T1)
inline void prefetch(const void* p, int hint) {
  if (hint == 3)
    _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
  else
    _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
}
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
