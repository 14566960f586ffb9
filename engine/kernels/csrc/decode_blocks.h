// Building blocks of the paged decode kernel (paged_attention_cpu.cpp): row prefetch
// and staging, the scores of one query head against 16 K rows (QRow) and the p.V
// accumulation of one head over a block of V rows (VPass), generic fp32 lanes and
// AVX512-BF16 forms.
// Included inside the kernel's anonymous namespace, after vec16.h and kBlock.
#pragma once

// ---- row staging -----------------------------------------------------------------------
template <typename scalar_t>
inline void prefetch_row(const scalar_t* p, int dim, int hint = 3) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int off = 0; off < dim * static_cast<int>(sizeof(scalar_t)); off += 64) prefetch(c + off, hint);
}
// one 64-byte line from p to 64-byte aligned dst
inline void vstore_raw(void* dst, const void* p) {
#if defined(__AVX512F__)
  _mm512_store_si512(dst, _mm512_loadu_si512(p));
#else
  std::memcpy(dst, p, 64);
#endif
}

// an output row, src * mul, in the output's dtype
inline void store_row(float* dst, const float* src, int n, float mul) {
  for (int i = 0; i < n; ++i) dst[i] = src[i] * mul;
}
inline void store_row(c10::BFloat16* dst, const float* src, int n, float mul) {
  for (int i = 0; i < n; ++i) dst[i] = c10::BFloat16(src[i] * mul);  // round to nearest even
}

// ---- scores of one query head against 16 K rows --------------------------------------
// q: the head's query (fp32 lanes, or raw bf16 pairs for vdpbf16ps); rows[t]: K row pointers.
// Returns lane t = q . K[t] (unscaled) for t < n, 1 <= n <= 16; the lanes >= n are garbage
// (they re-read row 0, or stay 0) and callers mask them. A V16 has 16 lanes: n above 16
// once overran it in the lane-array form (the head_dim-256 decode bug on AVX2 CPUs).
#if defined(__AVX512F__)
// lane t of the result = sum of all lanes of a[t]; 48 instructions instead of 16 horizontal sums
inline V16 hsum16(const __m512 (&a)[16]) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: (x0+x2, y0+y2, x1+x3, y1+y3)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: partial sums of 4 consecutive rows
    __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // fold the four 128-bit lanes: lane k of the result holds rows 4k..4k+3
  __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, 0x88), _mm512_shuffle_f32x4(e0, e1, 0xDD))};
}
#elif defined(__AVX2__) && defined(__FMA__)
// lane t of the result = sum of all lanes of a[t], t < 8: two hadd rounds leave rows 0-3
// (and 4-7) summed within each 128-bit half; adding the halves finishes them.
inline __m256 hsum8(const __m256* a) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}
#endif

template <typename scalar_t, int NV>
struct QRow {  // one query head, ready for dot products
  V16 v[NV];
  void load(const scalar_t* p) { for (int i = 0; i < NV; ++i) v[i] = vload(p + 16 * i); }
  V16 lanes(const scalar_t* k) const {  // q * K row, summed over the NV chunks (not yet over lanes)
    V16 s = vmul(v[0], vload(k));
    for (int i = 1; i < NV; ++i) s = vfma(v[i], vload(k + 16 * i), s);
    return s;
  }
  V16 dot16(const scalar_t* const* rows, int n) const {
#if defined(__AVX512F__)
    __m512 a[16];
    for (int t = 0; t < 16; ++t) a[t] = lanes(rows[t < n ? t : 0]).v;
    return hsum16(a);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 a[16];
    for (int t = 0; t < 16; ++t) {
      const V16 s = lanes(rows[t < n ? t : 0]);
      a[t] = _mm256_add_ps(s.lo, s.hi);
    }
    return {hsum8(a), hsum8(a + 8)};
#else
    V16 r = vzero();
    for (int t = 0, m = std::min(n, 16); t < m; ++t) r.v[t] = vsum(lanes(rows[t]));
    return r;
#endif
  }
};

#if defined(__AVX512BF16__)
// bf16 K and q: vdpbf16ps multiplies bf16 pairs exactly and accumulates in fp32, no conversion.
template <int NV>
struct QRow<c10::BFloat16, NV> {
  static constexpr int NW = NV / 2;  // 32 bf16 per register
  __m512bh w[NW > 0 ? NW : 1];
  void load(const c10::BFloat16* p) {
    for (int i = 0; i < NW; ++i) w[i] = (__m512bh)_mm512_loadu_si512(p + 32 * i);
  }
  V16 dot16(const c10::BFloat16* const* rows, int n) const {
    __m512 a[16];
    for (int t = 0; t < 16; ++t) {
      const c10::BFloat16* k = rows[t < n ? t : 0];
      __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), w[0], (__m512bh)_mm512_loadu_si512(k));
      for (int i = 1; i < NW; ++i) s = _mm512_dpbf16_ps(s, w[i], (__m512bh)_mm512_loadu_si512(k + 32 * i));
      a[t] = s;
    }
    return hsum16(a);
  }
};
#endif

// ---- the V pass: acc = alpha * acc + sum_j p_j V_j for one query head --------------------
// fill() runs once per block (shared by the G heads), accumulate() once per head.
// Both forms first copy the block's V rows into a contiguous scratch: pool rows of one
// request can sit a power-of-two stride apart (page_size 1, slot = t * batch + b), so
// they share a few cache sets and would evict each other between the G heads' passes.
// Generic form: V rows as fp32.
template <typename scalar_t, int NV>
struct VPass {
  static constexpr int D = NV * 16;
  alignas(64) float rows[kBlock][D];
  void fill(const scalar_t* const* src, int n) {
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < NV; ++i) vstore(rows[j] + 16 * i, vload(src[j] + 16 * i));
  }
  void accumulate(float* acc, const float* p, int n, float alpha) const {
    V16 a[NV];
    const V16 av = vset1(alpha);
    for (int i = 0; i < NV; ++i) a[i] = vmul(vload(acc + 16 * i), av);
    for (int j = 0; j < n; ++j) {
      const V16 pj = vset1(p[j]);
      for (int i = 0; i < NV; ++i) a[i] = vfma(pj, vload(rows[j] + 16 * i), a[i]);
    }
    for (int i = 0; i < NV; ++i) vstore(acc + 16 * i, a[i]);
  }
  static void finish(float*) {}
};

#if defined(__AVX512BF16__)
// bf16: tokens go in pairs through vdpbf16ps, p rounded to bf16 (as torch's CPU flash
// attention does for its P.V product). fill() interleaves the two V rows of a pair:
//   unpack{lo,hi}_epi16 per 128-bit lane L of 32-dim chunk c, so acc register 2c+h,
//   lane 4L+k holds dim 32c + 8L + 4h + k; finish() restores the natural order.
template <int NV>
struct VPass<c10::BFloat16, NV> {
  static constexpr int D = NV * 16;
  static_assert(NV % 2 == 0, "bf16 V pass needs head_dim % 32 == 0");
  __m512i pairs[kBlock / 2][NV];
  void fill(const c10::BFloat16* const* src, int n) {
    for (int j = 0; j < n; j += 2) {
      const c10::BFloat16* r0 = src[j];
      const c10::BFloat16* r1 = j + 1 < n ? src[j + 1] : src[j];  // its p is 0
      for (int c = 0; c < NV / 2; ++c) {
        const __m512i x0 = _mm512_loadu_si512(r0 + 32 * c), x1 = _mm512_loadu_si512(r1 + 32 * c);
        pairs[j / 2][2 * c] = _mm512_unpacklo_epi16(x0, x1);
        pairs[j / 2][2 * c + 1] = _mm512_unpackhi_epi16(x0, x1);
      }
    }
  }
  void accumulate(float* acc, const float* p, int n, float alpha) const {
    alignas(64) uint32_t pb[kBlock / 2];  // (p_j, p_j+1) as a bf16 pair
    for (int j = 0; j < n; j += 16) {
      const __m256bh h = _mm512_cvtneps_pbh(vload_n(p + j, std::min(16, n - j), 0.f).v);
      _mm256_store_si256(reinterpret_cast<__m256i*>(pb + j / 2), (__m256i)h);
    }
    __m512 a[NV];
    const __m512 av = _mm512_set1_ps(alpha);
    for (int i = 0; i < NV; ++i) a[i] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * i), av);
    for (int j = 0; j < (n + 1) / 2; ++j) {
      const __m512bh pj = (__m512bh)_mm512_set1_epi32(static_cast<int>(pb[j]));
      for (int i = 0; i < NV; ++i) a[i] = _mm512_dpbf16_ps(a[i], pj, (__m512bh)pairs[j][i]);
    }
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc + 16 * i, a[i]);
  }
  static void finish(float* acc) {
    alignas(64) float nat[D];
    for (int r = 0; r < NV; ++r)
      for (int L = 0; L < 4; ++L)
        for (int k = 0; k < 4; ++k) nat[32 * (r / 2) + 8 * L + 4 * (r % 2) + k] = acc[16 * r + 4 * L + k];
    for (int d = 0; d < D; ++d) acc[d] = nat[d];
  }
};
#endif

