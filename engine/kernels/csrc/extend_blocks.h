// Building blocks of the paged extend kernel (extend_attention_cpu.cpp), fp32 form:
// packing a kv range, the scores of a block of rows against 32 packed K positions, and
// the rows' p.V accumulation (extend_amx.h has the AMX form).
// Both are outer products, a broadcast scalar times a 16-lane vector of the packed
// block, over kTile rows at a time so their accumulators and one block row stay in
// registers. Included inside the kernel's anonymous namespace, after vec16.h and kKv.
//
// Tried, not kept: the same products as AVX512-BF16 pairs (vdpbf16ps on bf16 K, V and
// p). It was correct but ~1.2x slower here: vdpbf16ps issues on one port where fp32
// FMAs issue on two, so it does no more work per cycle, and the pair broadcasts cost.
// AMX tiles (extend_amx.h) do gain: 1.15-1.36x.
#pragma once

// Packs kv positions [0, n) of one head (K, V point at its first dim) into Kt (per
// 32-position block: [d][32], fp32, zero past n) and Vf ([t][d], fp32).
template <typename scalar_t, int NV>
void pack_kv(const scalar_t* K, const scalar_t* V, int64_t kv_ss, const int32_t* slots, int n,
             std::vector<float>& kt_buf, std::vector<float>& vf_buf) {
  constexpr int D = NV * 16;
  const int blocks = (n + kKv - 1) / kKv;
  kt_buf.resize(static_cast<size_t>(blocks) * D * kKv);
  vf_buf.resize(static_cast<size_t>(blocks) * kKv * D);
  for (int blk = 0; blk < blocks; ++blk) {
    float* kt = kt_buf.data() + static_cast<size_t>(blk) * D * kKv;
    float* vf = vf_buf.data() + static_cast<size_t>(blk) * kKv * D;
    for (int t = 0; t < kKv; ++t) {
      const int pos = blk * kKv + t;
      if (pos >= n) {
        for (int d = 0; d < D; ++d) kt[d * kKv + t] = 0.f;
        for (int c = 0; c < NV; ++c) vstore(vf + t * D + 16 * c, vzero());
        continue;
      }
      const int64_t off = static_cast<int64_t>(slots[pos]) * kv_ss;
      for (int d = 0; d < D; ++d) kt[d * kKv + t] = static_cast<float>(K[off + d]);
      for (int c = 0; c < NV; ++c) vstore(vf + t * D + 16 * c, vload(V + off + 16 * c));
    }
  }
}

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
