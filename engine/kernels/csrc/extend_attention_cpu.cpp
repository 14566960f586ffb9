// Paged extend (prefill) attention for CPU: every extend request of a batch in one call,
// K/V read straight from the paged pool through req_to_token. The new tokens' K/V are
// stored there before the call, so a cached prefix and the new tokens are read alike and
// a prefix needs no gather copy (loaded by engine/cpu_kernels.py).
//
// Request b has prefix_lens[b] cached tokens and extend_lens[b] new ones; its queries are
// rows [q_starts[b], q_starts[b] + extend_lens[b]) of q. New token j is at position
// p = prefix + j and attends to kv positions 0..p (causal, aligned bottom-right).
//
// One work item is (b, kv head h, a span of up to kSpan query tokens). It packs the
// span's kv range once:
//
//   Kt[d][t] = K[slot(t), h, d]     transposed, fp32: 16 positions per vector
//   Vf[t][d] = V[slot(t), h, d]     fp32
//
// and then takes the span q_tok tokens at a time. Their rows are the tokens x the G query
// heads of h (row r = token * G + g), so each packed K/V row serves all of them:
//
//   for each block of kKv kv positions t, up to the q_tok tokens' last position:
//     S[r][t]  = (scale q_r) . K_t    -inf where t > pos(r)
//     online softmax per row: m_r, l_r; O[r] *= exp(m_old - m_new)
//     O[r][:] += sum_t exp(S[r][t] - m_r) Vf[t][:]
//   out[r] = O[r] / l_r
//
// The products come in two forms. fp32 lanes (extend_blocks.h): a broadcast scalar
// (q_r[d], or p[r][t]) times a 16-wide vector of the packed block, a few rows at a
// time, fp32 throughout. AMX tiles (extend_amx.h), for bf16 on a CPU that has them:
// 16-row tile multiplies, p rounded to bf16 for p.V as torch's bf16 SDPA does.
// Accumulation is fp32 in both.
//
// Registered as torch.ops.tandem_cpu.paged_extend_attention (see the bottom).

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include "ops_library.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "dispatch.h"
#include "paged_args.h"
#include "run_dynamic.h"
#include "vec16.h"

namespace {
using namespace tandem_vec;
using tandem_dispatch::by_dtype;
using tandem_dispatch::by_head_dim;

constexpr int kKv = 32;     // kv positions per block: two vectors of scores per row
constexpr int kRows = 64;   // rows (query tokens x group heads) in one softmax pass
constexpr int kSpan = 256;  // query tokens per work item: its kv range is packed once

struct Problem : tandem_paged::PagedArgs {
  const int32_t* prefix_lens;
  const int32_t* extend_lens;
  const int32_t* q_starts;
  int q_tok;  // query tokens per softmax pass (kRows / group)
  float scale;
  bool use_amx;  // bf16 on a CPU with AMX: the tile products (extend_amx.h)
};

// Per-thread scratch of one item. The packed kv range (kt/vf, or kp/vp for AMX) grows
// with the item's range; the rest is sized for kRows rows of the largest head_dim.
struct Scratch {
  static constexpr size_t kMaxDim = 256;
  std::vector<float> qf = std::vector<float>(kRows * kMaxDim), kt, vf, s = std::vector<float>(kRows * kKv),
                     o = std::vector<float>(kRows * kMaxDim), m = std::vector<float>(kRows),
                     l = std::vector<float>(kRows);
  std::vector<uint16_t> qb = std::vector<uint16_t>(kRows * kMaxDim), kp, vp,
                        pb = std::vector<uint16_t>(kRows * kKv);
};

#include "extend_amx.h"
#include "extend_blocks.h"

// Online softmax of one block: S becomes P (0 past each row's causal limit), m and l
// advance, alpha[r] is the factor the row's O must be rescaled by.
inline void softmax_block(float* S, float* m, float* l, float* alpha, int rows, int n, int first_pos,
                          int t0, int group) {
  for (int r = 0; r < rows; ++r) {
    float* row = S + r * kKv;
    const int limit = std::min(n, first_pos + r / group - t0 + 1);  // keys t0 .. pos(r)
    if (limit <= 0) {  // the whole block is in this row's future
      alpha[r] = 1.f;
      for (int j = 0; j < kKv; j += 16) vstore(row + j, vzero());
      continue;
    }
    V16 mx = vset1(kNegInf);
    for (int j = 0; j < limit; j += 16) mx = vmax(mx, vload_n(row + j, std::min(16, limit - j), kNegInf));
    const float m_new = std::max(m[r], vhmax(mx));
    alpha[r] = std::exp(m[r] - m_new);  // exp(-inf) = 0 on the row's first block
    const V16 mv = vset1(m_new);
    V16 sum = vzero();
    for (int j = 0; j < kKv; j += 16) {
      const V16 p = vkeep_n(vexp(vsub(vload(row + j), mv)), std::max(0, std::min(16, limit - j)));
      vstore(row + j, p);
      sum = vadd(sum, p);
    }
    l[r] = l[r] * alpha[r] + vsum(sum);
    m[r] = m_new;
  }
}

// Rows [0, padded) of one q block as the scores read them: raw bf16 into qb for AMX,
// else fp32 pre-scaled into qf; rows past `rows` are zero.
template <typename scalar_t, int NV, bool kAmx>
void load_q(const Problem& P, Scratch& W, const scalar_t* block_q, int h, int rows, int padded) {
  constexpr int D = NV * 16;
  const int G = P.group;
  for (int r = 0; r < padded; ++r) {
    const scalar_t* src = block_q + (r / G) * P.q_st + (h * G + r % G) * P.q_sh;
    if constexpr (kAmx) {
      uint16_t* dst = W.qb.data() + r * D;
      if (r < rows) std::memcpy(dst, src, D * sizeof(uint16_t));
      else std::fill(dst, dst + D, uint16_t{0});
    } else {
      float* dst = W.qf.data() + r * D;
      for (int c = 0; c < NV; ++c) vstore(dst + 16 * c, r < rows ? vmul(vset1(P.scale), vload(src + 16 * c)) : vzero());
    }
  }
}

// Query tokens [j0, j1) of request b against kv head h: the kv range is packed once,
// then each block of q_tok tokens (<= kRows rows) runs the online softmax over it.
template <typename scalar_t, int NV, bool kAmx>
void extend_item(const Problem& P, Scratch& W, int b, int h, int j0, int j1) {
  constexpr int D = NV * 16, kRowStep = kAmx ? 16 : kTile<NV>;
  const int G = P.group, prefix = P.prefix_lens[b];
  const int32_t* slots = P.req_to_token + P.req_pool_indices[b] * P.r2t_stride;
  const scalar_t* K = static_cast<const scalar_t*>(P.k) + static_cast<int64_t>(h) * D;
  const scalar_t* V = static_cast<const scalar_t*>(P.v) + static_cast<int64_t>(h) * D;
  if constexpr (kAmx) {
    pack_kv_amx<NV>(K, V, P.kv_ss, slots, prefix + j1, W.kp, W.vp);
    load_tile_config();
  } else {
    pack_kv<scalar_t, NV>(K, V, P.kv_ss, slots, prefix + j1, W.kt, W.vf);
  }
  float *S = W.s.data(), *O = W.o.data();
  float alpha[kRows];
  for (int q0 = j0; q0 < j1; q0 += P.q_tok) {
    const int q1 = std::min(j1, q0 + P.q_tok);
    const int rows = (q1 - q0) * G, padded = (rows + kRowStep - 1) / kRowStep * kRowStep;
    const scalar_t* block_q = static_cast<const scalar_t*>(P.q) + (P.q_starts[b] + q0) * P.q_st;
    load_q<scalar_t, NV, kAmx>(P, W, block_q, h, rows, padded);
    std::fill(O, O + padded * D, 0.f);
    std::fill(W.m.begin(), W.m.begin() + padded, kNegInf);
    std::fill(W.l.begin(), W.l.begin() + padded, 0.f);
    const int kv_end = prefix + q1;  // the block's last query position + 1
    for (int t0 = 0; t0 < kv_end; t0 += kKv) {
      const int n = std::min(kKv, kv_end - t0);
      const size_t off = static_cast<size_t>(t0 / kKv) * D * kKv;  // the block, in either packing
      if constexpr (kAmx) scores_amx<NV>(W.qb.data(), W.kp.data() + off, P.scale, S, padded);
      else scores<NV>(W.qf.data(), W.kt.data() + off, S, padded);
      softmax_block(S, W.m.data(), W.l.data(), alpha, padded, n, prefix + q0, t0, G);
      if constexpr (kAmx) pv_amx<NV>(S, W.vp.data() + off, alpha, O, padded, W.pb.data());
      else accumulate_pv<NV>(S, W.vf.data() + off, alpha, O, padded, n);
    }
    for (int r = 0; r < rows; ++r) {
      scalar_t* dst = static_cast<scalar_t*>(P.out) + (P.q_starts[b] + q0 + r / G) * P.o_st +
                      (h * G + r % G) * P.o_sh;
      const V16 inv = vset1(W.l[r] > 0.f ? 1.f / W.l[r] : 0.f);
      for (int c = 0; c < NV; ++c) vstore(dst + 16 * c, vmul(inv, vload(O + r * D + 16 * c)));
    }
  }
  if constexpr (kAmx) tile_release();
}

template <typename scalar_t, int NV>
void run(const Problem& P, int batch) {
  // An item is (b, h, a span of up to kSpan query tokens); the costliest (longest kv
  // range) go first so the dynamic hand-out ends on cheap items.
  struct Item { int64_t cost; int b, h, j0, j1; };
  std::vector<Item> items;
  for (int b = 0; b < batch; ++b)
    for (int j0 = 0; j0 < P.extend_lens[b]; j0 += kSpan) {
      const int j1 = std::min(P.extend_lens[b], j0 + kSpan);
      for (int h = 0; h < P.hkv; ++h) items.push_back({static_cast<int64_t>(j1 - j0) * (P.prefix_lens[b] + j1), b, h, j0, j1});
    }
  std::sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  const bool amx = kHaveAmx && kBf16 && P.use_amx && amx_usable();
  tandem_par::run_dynamic(static_cast<int64_t>(items.size()), [&](int64_t i) {
    thread_local Scratch W;
    const Item& it = items[i];
    if constexpr (kHaveAmx && kBf16) {
      if (amx) return extend_item<scalar_t, NV, true>(P, W, it.b, it.h, it.j0, it.j1);
    }
    extend_item<scalar_t, NV, false>(P, W, it.b, it.h, it.j0, it.j1);
  });
}

void check_i32(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt && t.is_contiguous() && t.numel() == n, name,
              " must be contiguous int32 (batch,)");
}

void paged_extend_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_buffer,
                            const at::Tensor& v_buffer, const at::Tensor& req_to_token,
                            const at::Tensor& req_pool_indices, const at::Tensor& prefix_lens,
                            const at::Tensor& extend_lens, const at::Tensor& q_starts, double scale,
                            bool use_amx) {
  Problem P{};
  static_cast<tandem_paged::PagedArgs&>(P) = tandem_paged::paged_args(
      "paged_extend_attention", out, q, k_buffer, v_buffer, req_to_token, req_pool_indices, kRows);
  const int T = static_cast<int>(q.size(0)), B = static_cast<int>(req_pool_indices.numel());
  check_i32(prefix_lens, B, "prefix_lens");
  check_i32(extend_lens, B, "extend_lens");
  check_i32(q_starts, B, "q_starts");
  P.prefix_lens = prefix_lens.data_ptr<int32_t>();
  P.extend_lens = extend_lens.data_ptr<int32_t>();
  P.q_starts = q_starts.data_ptr<int32_t>();
  for (int b = 0; b < B; ++b) {
    TORCH_CHECK(P.prefix_lens[b] >= 0 && P.extend_lens[b] >= 0 &&
                    P.prefix_lens[b] + P.extend_lens[b] <= req_to_token.size(1), "prefix/extend lens out of range");
    TORCH_CHECK(P.q_starts[b] >= 0 && P.q_starts[b] + P.extend_lens[b] <= T, "q_starts out of range");
  }
  P.q_tok = std::max(1, kRows / P.group);
  P.scale = static_cast<float>(scale);
  P.use_amx = use_amx;
  by_dtype(q, "paged_extend_attention", [&](auto tag) {
    by_head_dim(q.size(2), "paged_extend_attention", [&](auto nv) { run<decltype(tag), decltype(nv)::value>(P, B); });
  });
}

}  // namespace

TANDEM_LIBRARY_FRAGMENT(TANDEM_OPS, m) {
  m.def(
      "paged_extend_attention(Tensor(a!) out, Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor req_to_token, "
      "Tensor req_pool_indices, Tensor prefix_lens, Tensor extend_lens, Tensor q_starts, float scale, "
      "bool use_amx) -> ()");
}

TANDEM_LIBRARY_IMPL(TANDEM_OPS, CPU, m) { m.impl("paged_extend_attention", &paged_extend_attention); }
