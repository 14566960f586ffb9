// The kernels' entry points, for a kernel that runs others in one call (decode_layer_cpu.cpp)
// instead of through the dispatcher. Each is what its op registers (torch.ops.tandem_cpu_<level>.*),
// with the same argument checks. The libraries are built with hidden visibility, so every level's
// library calls its own.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace tandem_entry {
// panel_linear_cpu.cpp
void panel_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& panels,
                  const std::optional<at::Tensor>& bias);
// expert_gemm_cpu.cpp
void expert_gemm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const at::Tensor& offsets);
// layer_ops_cpu.cpp
void rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& w, double eps);
void fused_add_rms_norm(const at::Tensor& x, const at::Tensor& res, const at::Tensor& w, double eps);
void silu_and_mul(const at::Tensor& out, const at::Tensor& gu);
void rope_qk(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
             const at::Tensor& q_norm_w, const at::Tensor& k_norm_w, int64_t hq, int64_t hkv, int64_t dim,
             double eps);
void store_kv(const at::Tensor& k_buffer, const at::Tensor& v_buffer, const at::Tensor& loc, const at::Tensor& k,
              const at::Tensor& v);
// paged_attention_cpu.cpp
void paged_decode_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_buffer,
                            const at::Tensor& v_buffer, const at::Tensor& req_to_token,
                            const at::Tensor& req_pool_indices, const at::Tensor& seq_lens, double scale,
                            int64_t num_splits);
}  // namespace tandem_entry
