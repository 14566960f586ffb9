// fp32 linears at decode and small-prefill sizes (loaded by engine/kernels/cpu_kernels.py, used by
// engine/models/layers.py, PackedLinear):
//
//   panel_linear(out, x, panels, bias):   out = x @ W.T (+ bias)
//
// x (M, K) fp32 rows; W (N, K) given as `panels` (P, K, 32), P = ceil(N / 32): panel p holds output
// features [32p, 32p + 32), its 32 weights for input feature k contiguous (zeros past N); out (M, N).
//
// Why a kernel: at these sizes every weight is cold (a step reads all of them once, more bytes than
// the last-level cache holds), and oneDNN's packed fp32 GEMM reads them in bursts that leave the
// memory idle in between (a whole decode step at 8-32 rows ran 1.3x faster here, at 64 rows 1.15x:
// docs/benchmarks.md, "fp32 linears in panels"). Here a thread owns whole panels. For each, blocks
// of up to kRows rows of x are multiplied against it with the accumulators in registers: the first
// block pulls the panel from memory, the others find it in L2. Meanwhile the *next* panel is
// prefetched, spread evenly over every block's k loop, so the memory streams at a steady rate all
// the time instead of only during the first block.
//
// Each output is one fp32 FMA chain over k in order, whatever M and the row blocking are: a row's
// result does not depend on the other rows of its call.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include "ops_library.h"

#include <algorithm>
#include <cstdint>
#include <array>
#include <optional>
#include <utility>

#include "entry_points.h"
#include "vec16.h"

namespace {
using namespace tandem_vec;

constexpr int kPanel = 32;  // output features per panel: two 16-lane vectors
#if defined(__AVX512F__)
constexpr int kLanesAtOnce = 32;  // a block covers the whole panel: 12 rows x 2 zmm accumulators
constexpr int kRows = 12;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanesAtOnce = 16;  // half a panel at a time: 6 rows x 2 ymm (one V16) + B + broadcast = 15 registers
constexpr int kRows = 6;
#else
constexpr int kLanesAtOnce = 32;
constexpr int kRows = 4;
#endif
constexpr int NV = kLanesAtOnce / 16;

// out rows [0, MR) x columns [c, c + 16 NV) of one panel += x rows . panel, k over [0, K).
// pf: the next panel's bytes this block prefetches, pf_step / 256 cache lines per k.
template <int MR>
inline void block(const float* x, int64_t sx, const float* b, int64_t K, float* out, int64_t so, int ncols,
                  const float* bias, const char* pf, int64_t pf_step) {
  V16 acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    V16 w[NV];
    for (int v = 0; v < NV; ++v) w[v] = vload(b + k * kPanel + 16 * v);
    if (pf != nullptr) prefetch(pf + ((k * pf_step) >> 8) * 64, 2);
    for (int i = 0; i < MR; ++i) {
      const V16 a = vset1(x[i * sx + k]);
      for (int v = 0; v < NV; ++v) acc[i][v] = vfma(a, w[v], acc[i][v]);
    }
  }
  for (int v = 0; v < NV; ++v) {
    const int n = std::min(16, ncols - 16 * v);
    if (n <= 0) break;
    const V16 bv = bias != nullptr ? vload_n(bias + 16 * v, n, 0.f) : vzero();
    for (int i = 0; i < MR; ++i) {
      const V16 r = vadd(acc[i][v], bv);
      if (n == 16) vstore(out + i * so + 16 * v, r);
      else vstore_n(out + i * so + 16 * v, n, r);
    }
  }
}

using BlockFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int, const float*,
                         const char*, int64_t);

template <int... R>
constexpr auto block_table(std::integer_sequence<int, R...>) {
  return std::array<BlockFn, sizeof...(R)>{&block<R + 1>...};
}
constexpr auto kBlocks = block_table(std::make_integer_sequence<int, kRows>{});

}  // namespace

namespace tandem_entry {

void panel_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& panels,
                  const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(out.device().is_cpu() && x.device().is_cpu() && panels.device().is_cpu(), "panel_linear is CPU-only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "panel_linear: float32 only");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && panels.dim() == 3 && panels.size(2) == kPanel,
              "panel_linear: x (M, K), panels (P, K, 32), out (M, N)");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0), N = out.size(1);
  TORCH_CHECK(panels.size(1) == K && out.size(0) == M && N <= P * kPanel && N > (P - 1) * kPanel,
              "panel_linear: shapes disagree");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1 && panels.is_contiguous(), "panel_linear: rows must be contiguous");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->numel() == N && bias->is_contiguous(),
                "panel_linear: bias (N,) float32");
    bp = bias->data_ptr<float>();
  }
  if (M == 0 || N == 0) return;
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t sx = x.stride(0), so = out.stride(0);
  const int64_t blocks = (M + kRows - 1) / kRows;
  const int64_t slices = kPanel / kLanesAtOnce;
  // the next panel is 2K lines (K * 128 bytes); each of the (blocks x slices) k loops covers its share
  const int64_t passes = blocks * slices;
  const int64_t pf_step = (2 * 256) / passes;  // 1/256ths of a line per k
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const float* b = wp + p * K * kPanel;
      const char* next = p + 1 < p1 ? reinterpret_cast<const char*>(b + K * kPanel) : nullptr;
      const int ncols = static_cast<int>(std::min<int64_t>(kPanel, N - p * kPanel));
      for (int64_t j = 0; j < blocks; ++j) {
        const int64_t m0 = j * M / blocks, m1 = (j + 1) * M / blocks;  // balanced: 64 rows are 6 x 10-11
        for (int64_t s = 0; s < slices; ++s) {
          const int c = static_cast<int>(s * kLanesAtOnce);
          if (c >= ncols) break;
          const int64_t pass = j * slices + s;
          const char* pf = next == nullptr || pf_step == 0 ? nullptr : next + ((2 * K * pass) / passes) * 64;
          kBlocks[m1 - m0 - 1](xp + m0 * sx, sx, b + c, K, op + m0 * so + p * kPanel + c, so, ncols - c,
                               bp == nullptr ? nullptr : bp + p * kPanel + c, pf, pf_step);
        }
      }
    }
  });
}

}  // namespace tandem_entry

TANDEM_LIBRARY_FRAGMENT(TANDEM_OPS, m) { m.def("panel_linear(Tensor(a!) out, Tensor x, Tensor panels, Tensor? bias) -> ()"); }

TANDEM_LIBRARY_IMPL(TANDEM_OPS, CPU, m) { m.impl("panel_linear", &tandem_entry::panel_linear); }
