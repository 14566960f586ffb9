// Fused paged decode attention for CPU: reads K/V straight from the paged pool
// through req_to_token, with no gather copy (loaded by engine/attention/cpu_kernels.py).
//
// One work item is (b, a chunk of kv heads, split s); per kv head h of the chunk:
//
//   row = req_pool_indices[b]; it covers tokens [t0, t1) of request b, t1 <= seq_lens[b]
//   for each block of kBlock tokens:
//     slot    = req_to_token[row, t]                          page size is irrelevant here
//     S[g][t] = scale * q[b, h*G + g] . K[slot, h]            G = Hq / Hkv query heads
//     online softmax per g: running max m[g], running sum l[g], rescale acc[g]
//     acc[g] += exp(S[g][t] - m[g]) * V[slot, h]
//
// Every K and V row is read from the pool exactly once and serves all G query heads of
// its group: per block and head it is staged into an L1 scratch (see VPass for why).
// The chunk's rows of one slot are contiguous, so the next block is prefetched into L2
// as whole rows meanwhile. Accumulation is fp32. With AVX512-BF16, bf16 q.K and p.V
// use vdpbf16ps (p rounded to bf16 for the p.V product, as torch's CPU flash attention does).
//
// Splits: when B * Hkv items are too few to keep every thread busy, each
// sequence is cut into `num_splits` token ranges of `split_len`; each range
// keeps its unnormalised (acc, m, l) and a merge pass combines them:
//
//   M = max_s m_s;   out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s
//
// Registered as torch.ops.tandem_cpu.paged_decode_attention (see the bottom).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include "ops_library.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "dispatch.h"
#include "entry_points.h"
#include "paged_args.h"
#include "run_dynamic.h"
#include "vec16.h"

namespace {
using namespace tandem_vec;
using tandem_dispatch::by_dtype;
using tandem_dispatch::by_head_dim;

constexpr int kBlock = 32;     // tokens scored before one softmax + V pass (scores stay in L1)
constexpr int kMaxGroup = 16;  // query heads per kv head
constexpr int kMaxAccFloats = 4096;  // an item's fp32 accumulators (16 KB): bounds its query heads
constexpr int kHintNext = 2;   // prefetch the next block into L2 (L1 is too small and too conflicted)


struct Problem : tandem_paged::PagedArgs {
  const int32_t* seq_lens;
  int batch;
  int heads_per_item;         // kv heads one work item covers (a divisor of hkv)
  int num_splits, split_len;  // split s covers tokens [s*split_len, (s+1)*split_len)
  float scale;
  float* partial;  // (batch, hkv, num_splits, group, dim + 2): acc, m, l; null when 1 split
};

#include "decode_blocks.h"
using tandem_par::run_dynamic;

// One (b, kv-head chunk, split) work item; NV = dim / 16. The chunk is kv heads
// [h0, h0 + heads_per_item): a slot's K (or V) row for those heads is contiguous
// (heads_per_item * dim elements), so the item streams whole rows from memory instead
// of one head's 128 bytes out of every row, and each head's pass then reads L1/L2.
template <typename scalar_t, int NV>
void decode_item(const Problem& P, int b, int h0, int s) {
  constexpr int D = NV * 16;
  constexpr int kMaxHeads = kMaxAccFloats / D;  // query heads one item can carry
  const int G = P.group, HC = P.heads_per_item, QH = HC * G;
  const int t0 = s * P.split_len;
  const int t1 = std::min<int>(P.seq_lens[b], t0 + P.split_len);
  const int32_t* slots = P.req_to_token + P.req_pool_indices[b] * P.r2t_stride;
  const scalar_t* kbase = static_cast<const scalar_t*>(P.k) + static_cast<int64_t>(h0) * D;
  const scalar_t* vbase = static_cast<const scalar_t*>(P.v) + static_cast<int64_t>(h0) * D;

  alignas(64) float acc[kMaxHeads][D];     // (query head of the chunk, dim) unnormalised output
  alignas(64) float S[kBlock];             // one head's block of scores, then probabilities
  QRow<scalar_t, NV> qrow[kMaxHeads];
  float m[kMaxHeads], l[kMaxHeads];
  alignas(64) scalar_t kblk[kBlock][D];    // one head's block of K rows, contiguous
  const scalar_t* krows[kBlock];
  const scalar_t* vrows[kBlock];
  for (int j = 0; j < kBlock; ++j) krows[j] = kblk[j];
  VPass<scalar_t, NV> vpass;
  for (int q = 0; q < QH; ++q) {
    qrow[q].load(static_cast<const scalar_t*>(P.q) + b * P.q_st + (h0 * G + q) * P.q_sh);
    for (int i = 0; i < NV; ++i) vstore(acc[q] + 16 * i, vzero());
    m[q] = kNegInf;
    l[q] = 0.f;
  }
  // Prefetch one block ahead: the rows are scattered, so the hardware prefetcher can't.
  for (int t = t0; t < std::min(t1, t0 + kBlock); ++t) {
    prefetch_row(kbase + slots[t] * P.kv_ss, HC * D);
    prefetch_row(vbase + slots[t] * P.kv_ss, HC * D);
  }
  const V16 scale = vset1(P.scale);

  for (int blk = t0; blk < t1; blk += kBlock) {
    const int n = std::min(kBlock, t1 - blk);
    // The next block's rows are prefetched a share per query head during the compute
    // below: issued all at once they fill the line-fill buffers and stall the core.
    const int next_n = std::max(0, std::min(kBlock, t1 - blk - kBlock));
    int prefetched = 0;
    for (int hh = 0; hh < HC; ++hh) {
      for (int j = 0; j < n; ++j) {
        const int64_t off = slots[blk + j] * P.kv_ss + hh * D;
        for (int i = 0; i < D; i += 64 / sizeof(scalar_t)) vstore_raw(&kblk[j][i], kbase + off + i);  // see VPass
        vrows[j] = vbase + off;
      }
      vpass.fill(vrows, n);
      for (int g = 0; g < G; ++g) {
        const int q = hh * G + g;
        for (const int upto = next_n * (q + 1) / QH; prefetched < upto; ++prefetched) {
          const int64_t slot = slots[blk + kBlock + prefetched];
          prefetch_row(kbase + slot * P.kv_ss, HC * D, kHintNext);
          prefetch_row(vbase + slot * P.kv_ss, HC * D, kHintNext);
        }
        // 1) scores, 16 tokens at a time; lanes >= n are garbage and masked below
        for (int j = 0; j < n; j += 16) vstore(S + j, vmul(qrow[q].dot16(krows + j, std::min(16, n - j)), scale));
        // 2) online softmax: raise the running max, S <- exp(S - m), rescale l and acc
        V16 mx = vset1(kNegInf);
        for (int j = 0; j < n; j += 16) mx = vmax(mx, vload_n(S + j, std::min(16, n - j), kNegInf));
        const float m_new = std::max(m[q], vhmax(mx));
        const float alpha = std::exp(m[q] - m_new);  // exp(-inf) = 0 on the first block
        const V16 mv = vset1(m_new);
        V16 sum = vzero();
        for (int j = 0; j < n; j += 16) {
          const int c = std::min(16, n - j);
          V16 p = vkeep_n(vexp(vsub(vload_n(S + j, c, 0.f), mv)), c);
          vstore_n(S + j, c, p);
          sum = vadd(sum, p);
        }
        l[q] = l[q] * alpha + vsum(sum);
        m[q] = m_new;
        // 3) acc = alpha * acc + sum_j p_j V_j
        vpass.accumulate(acc[q], S, n, alpha);
      }
    }
  }
  for (int q = 0; q < QH; ++q) VPass<scalar_t, NV>::finish(acc[q]);

  if (P.partial == nullptr) {
    for (int q = 0; q < QH; ++q) {
      scalar_t* op = static_cast<scalar_t*>(P.out) + b * P.o_st + (h0 * G + q) * P.o_sh;
      store_row(op, acc[q], D, l[q] > 0.f ? 1.f / l[q] : 0.f);  // l == 0 only for an empty sequence
    }
    return;
  }
  for (int hh = 0; hh < HC; ++hh) {
    float* part = P.partial + ((static_cast<int64_t>(b) * P.hkv + h0 + hh) * P.num_splits + s) * G * (D + 2);
    for (int g = 0; g < G; ++g) {
      const int q = hh * G + g;
      float* pg = part + g * (D + 2);
      for (int i = 0; i < D; ++i) pg[i] = acc[q][i];
      pg[D] = m[q];  // -inf for an empty split (t0 >= seq_len)
      pg[D + 1] = l[q];
    }
  }
}

// Combine the splits of (b, h) into the output.
template <typename scalar_t, int NV>
void merge_item(const Problem& P, int b, int h) {
  constexpr int D = NV * 16;
  const int G = P.group;
  const float* part = P.partial + (static_cast<int64_t>(b) * P.hkv + h) * P.num_splits * G * (D + 2);
  alignas(64) float acc[D];
  for (int g = 0; g < G; ++g) {
    float M = kNegInf;
    for (int s = 0; s < P.num_splits; ++s) M = std::max(M, part[(s * G + g) * (D + 2) + D]);
    for (int i = 0; i < D; ++i) acc[i] = 0.f;
    float L = 0.f;
    for (int s = 0; s < P.num_splits; ++s) {
      const float* pg = part + (s * G + g) * (D + 2);
      if (pg[D] == kNegInf) continue;  // empty split
      const float w = std::exp(pg[D] - M);
      L += w * pg[D + 1];
      const V16 wv = vset1(w);
      for (int i = 0; i < NV; ++i) vstore(acc + 16 * i, vfma(wv, vload(pg + 16 * i), vload(acc + 16 * i)));
    }
    scalar_t* op = static_cast<scalar_t*>(P.out) + b * P.o_st + (h * G + g) * P.o_sh;
    store_row(op, acc, D, L > 0.f ? 1.f / L : 0.f);
  }
}

template <typename scalar_t, int NV>
void run(const Problem& P) {
  const int chunks = P.hkv / P.heads_per_item;
  const int64_t items = static_cast<int64_t>(P.batch) * chunks * P.num_splits;
  run_dynamic(items, [&](int64_t i) {
    const int s = static_cast<int>(i % P.num_splits);
    const int64_t bc = i / P.num_splits;
    decode_item<scalar_t, NV>(P, static_cast<int>(bc / chunks), static_cast<int>(bc % chunks) * P.heads_per_item, s);
  });
  if (P.partial != nullptr) {
    run_dynamic(static_cast<int64_t>(P.batch) * P.hkv, [&](int64_t bh) {
      merge_item<scalar_t, NV>(P, static_cast<int>(bh / P.hkv), static_cast<int>(bh % P.hkv));
    });
  }
}

}  // namespace

namespace tandem_entry {

void paged_decode_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_buffer,
                            const at::Tensor& v_buffer, const at::Tensor& req_to_token,
                            const at::Tensor& req_pool_indices, const at::Tensor& seq_lens, double scale,
                            int64_t num_splits) {
  Problem P{};
  static_cast<tandem_paged::PagedArgs&>(P) = tandem_paged::paged_args(
      "paged_decode_attention", out, q, k_buffer, v_buffer, req_to_token, req_pool_indices, kMaxGroup);
  const int B = static_cast<int>(q.size(0)), D = static_cast<int>(q.size(2)), Hkv = P.hkv;
  TORCH_CHECK(req_pool_indices.numel() == B, "paged_decode_attention: one req_pool_index per q row");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() && seq_lens.numel() == B,
              "seq_lens must be contiguous int32 (batch,)");
  if (B == 0) return;
  P.seq_lens = seq_lens.data_ptr<int32_t>();
  P.batch = B;
  P.scale = static_cast<float>(scale);
  // As many kv heads per item as the accumulators hold (the largest divisor of Hkv);
  // G <= kMaxGroup and D <= 256 guarantee at least one.
  P.heads_per_item = 1;
  for (int hc = Hkv; hc >= 1; --hc) {
    if (Hkv % hc == 0 && hc * P.group * D <= kMaxAccFloats) {
      P.heads_per_item = hc;
      break;
    }
  }

  int max_len = 0;
  for (int b = 0; b < B; ++b) {
    TORCH_CHECK(P.seq_lens[b] >= 0 && P.seq_lens[b] <= req_to_token.size(1), "seq_lens out of range");
    max_len = std::max(max_len, P.seq_lens[b]);
  }
  // num_splits <= 0 picks: ~4 items per thread, each split keeping >= 256 tokens (on 2 cores
  // splitting a 256-token batch-1 decode measured slightly slower, 2048 tokens slightly faster).
  // Never split below kBlock tokens.
  int splits = static_cast<int>(num_splits);
  if (splits <= 0) {
    const int items = B * (Hkv / P.heads_per_item), want = 4 * at::get_num_threads();
    splits = items >= want ? 1 : std::min((want + items - 1) / items, std::max(1, max_len / 256));
  }
  splits = std::max(1, std::min(splits, (max_len + kBlock - 1) / kBlock));
  P.num_splits = splits;
  P.split_len = splits == 1 ? std::max(max_len, 1) : ((max_len + splits - 1) / splits + kBlock - 1) / kBlock * kBlock;
  std::vector<float> partial;
  if (splits > 1) {
    partial.resize(static_cast<size_t>(B) * Hkv * splits * P.group * (D + 2));
    P.partial = partial.data();
  }
  by_dtype(q, "paged_decode_attention", [&](auto tag) {
    by_head_dim(D, "paged_decode_attention", [&](auto nv) { run<decltype(tag), decltype(nv)::value>(P); });
  });
}

}  // namespace tandem_entry

TANDEM_LIBRARY(TANDEM_OPS, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_buffer, Tensor v_buffer, "
      "Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, float scale, int num_splits) -> ()");
}

TANDEM_LIBRARY_IMPL(TANDEM_OPS, CPU, m) { m.impl("paged_decode_attention", &tandem_entry::paged_decode_attention); }
