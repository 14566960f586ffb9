// The experts' projections of a mixture-of-experts block at decode sizes (loaded by
// engine/kernels/cpu_kernels.py, used by engine/models/expert_mlp.py):
//
//   expert_gemm(out, x, w, offsets):   out[r] = T(w[e] @ x[r])   for r in [offsets[e-1], offsets[e])
//
// x (S, K) the pairs' rows sorted by expert, w (E, N, K) each expert's weight as stored (output
// features by input features), offsets (E,) int32 cumulative row counts; out (S, N). Rows past
// offsets[E-1] (other ranks' experts) are left unwritten. Accumulates in fp32 and rounds once,
// as torch's bf16 matmul does.
//
// Why a kernel: at decode an expert gets a row or two. torch's grouped matmul runs a matmul per
// expert, the empty ones too, and oneDNN's per-expert matmuls pay a dispatch each; both read the
// reached experts' weights at a quarter of this machine's read bandwidth (bench/moe_block_cpu.py).
// Here one parallel pass streams each reached expert's weight once: a task is one expert and a
// block of its weight rows, and every row routed to that expert is multiplied against each weight
// row while it is in cache.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include "ops_library.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "dispatch.h"
#include "entry_points.h"
#include "vec16.h"

namespace {

using namespace tandem_vec;
using tandem_dispatch::by_dtype;

constexpr int64_t kRowsPerTask = 32;  // weight rows: 64 KB of bf16 at K = 1024, L2-resident across token rows
constexpr int kTokensAtOnce = 4;      // token rows sharing one pass over a weight row

// out[i * so + n] for the M token rows at x (stride sx) against weight row wr of length k
template <int M, typename T>
inline void dot_rows(T* out, int64_t so, const T* x, int64_t sx, const T* wr, int64_t k) {
  V16 acc[M];
  for (int i = 0; i < M; ++i) acc[i] = vzero();
  for (int64_t j = 0; j < k; j += 16) {
    const V16 wv = vload(wr + j);
    for (int i = 0; i < M; ++i) acc[i] = vfma(wv, vload(x + i * sx + j), acc[i]);
  }
  for (int i = 0; i < M; ++i) out[i * so] = static_cast<T>(vsum(acc[i]));
}

template <typename T>
void expert_gemm_impl(const at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const int32_t* off) {
  const int64_t experts = w.size(0), n_out = w.size(1), k = w.size(2);
  const int64_t sx = x.stride(0), so = out.stride(0), sw0 = w.stride(0), sw1 = w.stride(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (expert, first weight row), reached experts only
  for (int64_t e = 0; e < experts; ++e)
    if (off[e] > (e ? off[e - 1] : 0))
      for (int64_t n0 = 0; n0 < n_out; n0 += kRowsPerTask) tasks.emplace_back(e, n0);
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      const auto [e, n0] = tasks[t];
      const int64_t r1 = off[e], n1 = std::min(n_out, n0 + kRowsPerTask);
      for (int64_t r = e ? off[e - 1] : 0; r < r1; r += kTokensAtOnce) {
        const T* xr = xp + r * sx;
        for (int64_t n = n0; n < n1; ++n) {
          const T* wr = wp + e * sw0 + n * sw1;
          T* o = op + r * so + n;
          switch (std::min<int64_t>(kTokensAtOnce, r1 - r)) {
            case 1: dot_rows<1>(o, so, xr, sx, wr, k); break;
            case 2: dot_rows<2>(o, so, xr, sx, wr, k); break;
            case 3: dot_rows<3>(o, so, xr, sx, wr, k); break;
            default: dot_rows<4>(o, so, xr, sx, wr, k); break;
          }
        }
      }
    }
  });
}

}  // namespace

namespace tandem_entry {

void expert_gemm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const at::Tensor& offsets) {
  TORCH_CHECK(out.device().is_cpu() && x.device().is_cpu() && w.device().is_cpu() && offsets.device().is_cpu(),
              "expert_gemm is CPU-only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && out.dim() == 2, "expert_gemm: x (S, K), w (E, N, K), out (S, N)");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && out.scalar_type() == x.scalar_type(),
              "expert_gemm: one dtype for x, w and out");
  TORCH_CHECK(x.size(1) == w.size(2) && out.size(0) == x.size(0) && out.size(1) == w.size(1),
              "expert_gemm: shapes disagree");
  TORCH_CHECK(w.size(2) % 16 == 0, "expert_gemm: the input features must be a multiple of 16");
  TORCH_CHECK(x.stride(1) == 1 && w.stride(2) == 1 && out.stride(1) == 1, "expert_gemm: rows must be contiguous");
  TORCH_CHECK(offsets.scalar_type() == at::kInt && offsets.is_contiguous() && offsets.numel() == w.size(0),
              "expert_gemm: offsets must be contiguous int32, one per expert");
  const int32_t* off = offsets.data_ptr<int32_t>();
  for (int64_t e = 0; e < offsets.numel(); ++e)
    TORCH_CHECK(off[e] >= (e ? off[e - 1] : 0) && off[e] <= x.size(0), "expert_gemm: offsets must rise within the rows");
  by_dtype(x, "expert_gemm", [&](auto tag) { expert_gemm_impl<decltype(tag)>(out, x, w, off); });
}

}  // namespace tandem_entry

TANDEM_LIBRARY_FRAGMENT(TANDEM_OPS, m) { m.def("expert_gemm(Tensor(a!) out, Tensor x, Tensor w, Tensor offsets) -> ()"); }

TANDEM_LIBRARY_IMPL(TANDEM_OPS, CPU, m) { m.impl("expert_gemm", &tandem_entry::expert_gemm); }
