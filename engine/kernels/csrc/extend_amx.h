// AMX form of the paged extend kernel's products (extend_attention_cpu.cpp), for bf16.
//
//   pack:    Kp[blk][d/2][32][2], Vp[blk][t/2][d][2]: raw bf16 in the VNNI pair layouts
//            the tile multiply reads as B (K for q.K^T, V for p.V)
//   scores:  per 16 rows: C(16 x 16 fp32) += A(q: 16 rows x 32 d) . B(K: 32 d x 16 positions),
//            two C tiles for the block's 32 positions, summed over head_dim / 32
//   p.V:     p rounded to bf16 (as torch's bf16 SDPA does); per 16 rows and 16 dims,
//            C = A(p: 16 rows x 32 positions) . B(V: 32 positions x 16 dims), then
//            O = O * alpha + C in fp32 with AVX-512
//
// Tiles (each 16 rows x 64 bytes): 0, 1 C; 2 A (q); 3, 4 B (K halves); 6 A (p); 7 B (V).
// Included inside the kernel's anonymous namespace, after vec16.h and kKv.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
constexpr bool kHaveAmx = true;

// Linux grants the AMX tile state only on request, once per process (oneDNN asks too).
inline bool amx_usable() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

inline void tile_release() { _tile_release(); }

inline void load_tile_config() {  // tile state is per thread, and oneDNN's matmuls reconfigure it
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

template <int NV>
void pack_kv_amx(const c10::BFloat16* K, const c10::BFloat16* V, int64_t kv_ss, const int32_t* slots, int n,
                 std::vector<uint16_t>& kp, std::vector<uint16_t>& vp) {
  constexpr int D = NV * 16;
  const size_t size = static_cast<size_t>((n + kKv - 1) / kKv) * D * kKv;
  kp.assign(size, 0);
  vp.assign(size, 0);
  for (int pos = 0; pos < n; ++pos) {
    uint16_t* kb = kp.data() + static_cast<size_t>(pos / kKv) * D * kKv + (pos % kKv) * 2;
    uint16_t* vb = vp.data() + static_cast<size_t>(pos / 2) * D * 2 + pos % 2;  // blocks are consecutive pairs
    const auto* kr = reinterpret_cast<const uint16_t*>(K + static_cast<int64_t>(slots[pos]) * kv_ss);
    const auto* vr = reinterpret_cast<const uint16_t*>(V + static_cast<int64_t>(slots[pos]) * kv_ss);
    for (int d = 0; d < D; ++d) {
      kb[(d / 2) * kKv * 2 + d % 2] = kr[d];
      vb[d * 2] = vr[d];
    }
  }
}

// S[r][0..32) = scale * q_r . K[0..32) for rows [0, rows), rows a multiple of 16.
template <int NV>
inline void scores_amx(const uint16_t* qb, const uint16_t* kp, float scale, float* S, int rows) {
  constexpr int D = NV * 16;
  for (int r0 = 0; r0 < rows; r0 += 16) {
    _tile_zero(0);
    _tile_zero(1);
    for (int dc = 0; dc < D / 32; ++dc) {
      _tile_loadd(2, qb + r0 * D + dc * 32, D * 2);
      _tile_loadd(3, kp + dc * 16 * kKv * 2, kKv * 4);
      _tile_loadd(4, kp + dc * 16 * kKv * 2 + 32, kKv * 4);
      _tile_dpbf16ps(0, 2, 3);
      _tile_dpbf16ps(1, 2, 4);
    }
    _tile_stored(0, S + r0 * kKv, kKv * 4);
    _tile_stored(1, S + r0 * kKv + 16, kKv * 4);
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int i = 0; i < rows * kKv; i += 16) _mm512_storeu_ps(S + i, _mm512_mul_ps(sc, _mm512_loadu_ps(S + i)));
}

// O[r] = O[r] * alpha[r] + sum_t bf16(P[r][t]) V[t] over the block, rows a multiple of 16.
template <int NV>
inline void pv_amx(const float* P, const uint16_t* vp, const float* alpha, float* O, int rows, uint16_t* pb) {
  constexpr int D = NV * 16;
  alignas(64) float part[16 * 16];
  for (int r = 0; r < rows; ++r) {
    const __m512bh p = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(P + r * kKv + 16), _mm512_loadu_ps(P + r * kKv));
    _mm512_storeu_si512(pb + r * kKv, (__m512i)p);
  }
  for (int r0 = 0; r0 < rows; r0 += 16) {
    _tile_loadd(6, pb + r0 * kKv, kKv * 2);
    for (int c = 0; c < NV; ++c) {
      _tile_zero(0);
      _tile_loadd(7, vp + c * 32, D * 4);
      _tile_dpbf16ps(0, 6, 7);
      _tile_stored(0, part, 64);
      for (int i = 0; i < 16; ++i) {
        float* o = O + (r0 + i) * D + 16 * c;
        _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_set1_ps(alpha[r0 + i]), _mm512_loadu_ps(o),
                                            _mm512_load_ps(part + 16 * i)));
      }
    }
  }
}
#else
constexpr bool kHaveAmx = false;
// Never called without AMX (kHaveAmx); declared so the kernel compiles everywhere.
inline bool amx_usable() { return false; }
inline void load_tile_config() {}
inline void tile_release() {}
template <int NV>
void pack_kv_amx(const c10::BFloat16*, const c10::BFloat16*, int64_t, const int32_t*, int, std::vector<uint16_t>&,
                 std::vector<uint16_t>&) {}
template <int NV>
inline void scores_amx(const uint16_t*, const uint16_t*, float, float*, int) {}
template <int NV>
inline void pv_amx(const float*, const uint16_t*, const float*, float*, int, uint16_t*) {}
#endif
