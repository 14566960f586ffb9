// One decoder layer of a CPU decode step in one call (loaded by engine/kernels/cpu_kernels.py, run by
// engine/models/fused_decode.py):
//
//   decode_layer(x, residual, first, weights, qkv_bias, positions, cos, sin, k_buffer, v_buffer, loc,
//                req_to_token, rows, seq_lens, hq, hkv, dim, eps, scale) -> x'
//
//     first layer:  residual = x;  h = rms_norm(x, ln1)
//     otherwise:    fused_add_rms_norm(x, residual, ln1);  h = x      (both in place)
//     qkv = linear(h, Wqkv, qkv_bias);  rope_qk(qkv, positions, ...)   [qk-norm when given]
//     store_kv(k_buffer, v_buffer, loc, k, v)
//     a = paged_decode_attention(q, k_buffer, v_buffer, req_to_token, rows, seq_lens)
//     o = linear(a, Wo);  fused_add_rms_norm(o, residual, ln2)
//     x' = linear(silu_and_mul(linear(o, Wgate_up)), Wdown)      (a new tensor)
//
//   weights = [ln1, ln2, Wqkv, Wo, Wgate_up, Wdown, q_norm, k_norm], q_norm/k_norm empty where the
//   model has no qk-norm. The linears are their small-rows form (models/layers.py, PackedLinear):
//   fp32 panels (cpu_kernels.pack_panels: panel_linear), or a bf16 weight as stored, streamed by
//   the experts' kernel with one expert (cpu_kernels.stream_linear), its bias added after.
//
// Why: these are the very kernels the layer's modules call, in the same order on the same
// tensors, so the result is the same bits. Called from Python they are ~20 Python-level ops per
// layer (module calls, views, splits, dispatches): the smollm2 decode step ran 1.41x faster at
// batch 1 and 1.10x at batch 64 without them (docs/benchmarks.md, "One call per decoder layer").

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include "ops_library.h"

#include <cstdint>
#include <optional>

#include "entry_points.h"

namespace {

// out = x @ W.T (+ bias), as PackedLinear's small-rows form computes it
void linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  if (w.dim() == 3) return tandem_entry::panel_linear(out, x, w, bias);
  TORCH_CHECK(w.dim() == 2, "decode_layer: a linear's weight is fp32 panels or a plain (N, K) weight");
  int32_t rows = static_cast<int32_t>(x.size(0));  // one expert owning every row
  tandem_entry::expert_gemm(out, x, w.unsqueeze(0), at::from_blob(&rows, {1}, at::TensorOptions().dtype(at::kInt)));
  if (bias.has_value() && bias->defined()) out.add_(*bias);
}

at::Tensor decode_layer(const at::Tensor& x, const at::Tensor& residual, bool first, at::TensorList weights,
                        const std::optional<at::Tensor>& qkv_bias, const at::Tensor& positions, const at::Tensor& cos,
                        const at::Tensor& sin, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                        const at::Tensor& loc, const at::Tensor& req_to_token, const at::Tensor& rows,
                        const at::Tensor& seq_lens, int64_t hq, int64_t hkv, int64_t dim, double eps, double scale) {
  TORCH_CHECK(weights.size() == 8, "decode_layer: weights are [ln1, ln2, qkv, o, gate_up, down, q_norm, k_norm]");
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.dim() == 2 && x.is_contiguous(),
              "decode_layer: x must be contiguous float32 or bfloat16 (tokens, hidden)");
  const at::Tensor &ln1 = weights[0], &ln2 = weights[1], &w_qkv = weights[2], &w_o = weights[3],
                   &w_gu = weights[4], &w_down = weights[5], &q_norm = weights[6], &k_norm = weights[7];
  TORCH_CHECK((w_down.dim() == 3 || w_down.dim() == 2) && hq > 0 && hkv > 0 && dim > 0,
              "decode_layer: a linear's weight is fp32 panels or a plain (N, K) weight");
  const int64_t n = x.size(0), hidden = x.size(1), inter = w_down.size(1);  // K either way
  TORCH_CHECK(positions.numel() == n && loc.numel() == n && rows.numel() == n,
              "decode_layer: one position, slot and request row per token");
  const auto act = x.options();

  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() && residual.is_contiguous(),
              "decode_layer: residual must be like x");
  at::Tensor h = x;
  if (first) {  // the embedding becomes the residual stream
    residual.copy_(x);
    h = at::empty({n, hidden}, act);
    tandem_entry::rms_norm(h, x, ln1, eps);
  } else {
    tandem_entry::fused_add_rms_norm(h, residual, ln1, eps);
  }

  const int64_t qw = hq * dim, kw = hkv * dim;
  at::Tensor qkv = at::empty({n, qw + 2 * kw}, act);
  linear(qkv, h, w_qkv, qkv_bias);
  tandem_entry::rope_qk(qkv, positions, cos, sin, q_norm, k_norm, hq, hkv, dim, eps);
  const at::Tensor q = qkv.narrow(1, 0, qw).view({n, hq, dim});
  const at::Tensor k = qkv.narrow(1, qw, kw).view({n, hkv, dim});
  const at::Tensor v = qkv.narrow(1, qw + kw, kw).view({n, hkv, dim});
  tandem_entry::store_kv(k_buffer, v_buffer, loc, k, v);
  at::Tensor attn = at::empty({n, hq, dim}, act);
  tandem_entry::paged_decode_attention(attn, q, k_buffer, v_buffer, req_to_token, rows, seq_lens, scale, 0);

  at::Tensor o = at::empty({n, hidden}, act);
  linear(o, attn.view({n, qw}), w_o, std::nullopt);
  tandem_entry::fused_add_rms_norm(o, residual, ln2, eps);
  at::Tensor gu = at::empty({n, 2 * inter}, act);
  linear(gu, o, w_gu, std::nullopt);
  at::Tensor mid = at::empty({n, inter}, act);
  tandem_entry::silu_and_mul(mid, gu);
  at::Tensor out = at::empty({n, hidden}, act);
  linear(out, mid, w_down, std::nullopt);
  return out;
}

}  // namespace

TANDEM_LIBRARY_FRAGMENT(TANDEM_OPS, m) {
  m.def(
      "decode_layer(Tensor(a!) x, Tensor(b!) residual, bool first, Tensor[] weights, Tensor? qkv_bias, "
      "Tensor positions, Tensor cos, Tensor sin, Tensor(c!) k_buffer, Tensor(d!) v_buffer, Tensor loc, "
      "Tensor req_to_token, Tensor rows, Tensor seq_lens, int num_q_heads, int num_kv_heads, int head_dim, "
      "float eps, float scale) -> Tensor");
}

TANDEM_LIBRARY_IMPL(TANDEM_OPS, CPU, m) { m.impl("decode_layer", &decode_layer); }
