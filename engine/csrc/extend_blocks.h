// Building blocks of the paged extend kernel (extend_attention_cpu.cpp): the scores
// of a block of rows against 32 packed K positions, and the rows' p.V accumulation.
// Both are outer products, a broadcast scalar times a 16-lane vector of the packed
// block, over kTile rows at a time so their accumulators and one block row stay in
// registers. Included inside the kernel's anonymous namespace, after vec16.h and kKv.
//
// Tried, not kept: the same products as AVX512-BF16 pairs (vdpbf16ps on bf16 K, V and
// p). It was correct but ~1.2x slower here: vdpbf16ps issues on one port where fp32
// FMAs issue on two, so it does no more work per cycle, and the pair broadcasts cost.
#pragma once

// Rows processed together: their accumulators plus one block row stay in registers.
template <int NV>
constexpr int kTile = NV <= 4 ? 4 : (NV <= 8 ? 2 : 1);

// S[r][0..32) = qf_r . Kt[.][0..32) for rows [r0, r0 + R); rows past R are padding.
template <int NV>
inline void scores(const float* qf, const float* kt, float* S, int rows) {
  constexpr int D = NV * 16, R = kTile<NV>;
  for (int r0 = 0; r0 < rows; r0 += R) {
    V16 acc[R][2];
    for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = vzero();
    for (int d = 0; d < D; ++d) {
      const V16 k0 = vload(kt + d * kKv), k1 = vload(kt + d * kKv + 16);
      for (int i = 0; i < R; ++i) {
        const V16 qv = vset1(qf[(r0 + i) * D + d]);
        acc[i][0] = vfma(qv, k0, acc[i][0]);
        acc[i][1] = vfma(qv, k1, acc[i][1]);
      }
    }
    for (int i = 0; i < R; ++i) {
      vstore(S + (r0 + i) * kKv, acc[i][0]);
      vstore(S + (r0 + i) * kKv + 16, acc[i][1]);
    }
  }
}

// O[r] = O[r] * alpha[r] + sum_t P[r][t] Vf[t] over t < n, for rows [0, rows).
template <int NV>
inline void accumulate_pv(const float* P, const float* vf, const float* alpha, float* O, int rows, int n) {
  constexpr int D = NV * 16, R = kTile<NV>;
  for (int r0 = 0; r0 < rows; r0 += R) {
    V16 acc[R][NV];
    for (int i = 0; i < R; ++i) {
      const V16 a = vset1(alpha[r0 + i]);
      for (int c = 0; c < NV; ++c) acc[i][c] = vmul(a, vload(O + (r0 + i) * D + 16 * c));
    }
    for (int t = 0; t < n; ++t) {
      V16 vrow[NV];
      for (int c = 0; c < NV; ++c) vrow[c] = vload(vf + t * D + 16 * c);
      for (int i = 0; i < R; ++i) {
        const V16 p = vset1(P[(r0 + i) * kKv + t]);
        for (int c = 0; c < NV; ++c) acc[i][c] = vfma(p, vrow[c], acc[i][c]);
      }
    }
    for (int i = 0; i < R; ++i)
      for (int c = 0; c < NV; ++c) vstore(O + (r0 + i) * D + 16 * c, acc[i][c]);
  }
}
