// The arguments shared by the paged attention kernels (decode and extend): q/out of one
// shape, K/V pool buffers of (slots, kv_heads, dim) rows in one dtype, the req_to_token
// table and the batch's rows in it. `paged_args` checks them and returns raw pointers;
// each kernel's Problem extends PagedArgs with its own fields.
#pragma once

#include <ATen/core/Tensor.h>

#include "dispatch.h"

namespace tandem_paged {
struct PagedArgs {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  const int32_t* req_to_token;
  const int64_t* req_pool_indices;
  int64_t q_st, q_sh;  // q strides (token, head); the dim stride is 1. Decode: a token per request
  int64_t o_st, o_sh;  // out strides
  int64_t kv_ss;       // k/v slot stride; each slot's (kv_heads, dim) is contiguous
  int64_t r2t_stride;  // req_to_token row stride
  int hkv, group;      // kv heads, query heads per kv head
};

inline PagedArgs paged_args(const char* op, const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_buffer,
                            const at::Tensor& v_buffer, const at::Tensor& req_to_token,
                            const at::Tensor& req_pool_indices, int64_t max_group) {
  TORCH_CHECK(q.device().is_cpu() && k_buffer.device().is_cpu(), op, " is CPU-only");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), op, ": q and out must be 3-D, of one shape");
  TORCH_CHECK(k_buffer.dim() == 3 && v_buffer.sizes() == k_buffer.sizes(), op, ": k/v must be (slots, kv_heads, dim)");
  const int64_t heads = q.size(1), dim = q.size(2), kv_heads = k_buffer.size(1);
  TORCH_CHECK(k_buffer.size(2) == dim, op, ": q and k head_dim differ");
  // Every check comes before a pointer is read: a kernel instantiated for another head_dim
  // must never see this shape.
  TORCH_CHECK(tandem_dispatch::supported_head_dim(dim), op, ": unsupported head_dim ", dim);
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, op,
              ": float32 or bfloat16 only, got ", q.scalar_type());
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= max_group, op, ": heads must be a multiple (<= ",
              max_group, "x) of kv_heads");
  TORCH_CHECK(q.scalar_type() == k_buffer.scalar_type() && v_buffer.scalar_type() == k_buffer.scalar_type() &&
                  out.scalar_type() == q.scalar_type(), op, ": q, k, v and out must share one dtype");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, op, ": q/out head_dim must be contiguous");
  TORCH_CHECK(k_buffer.stride(2) == 1 && k_buffer.stride(1) == dim && v_buffer.strides() == k_buffer.strides(),
              op, ": k/v rows (kv_heads, dim) must be contiguous");
  TORCH_CHECK(req_to_token.scalar_type() == at::kInt && req_to_token.dim() == 2 && req_to_token.stride(1) == 1,
              op, ": req_to_token must be int32 (rows, max_ctx) with contiguous rows");
  TORCH_CHECK(req_pool_indices.scalar_type() == at::kLong && req_pool_indices.is_contiguous(), op,
              ": req_pool_indices must be contiguous int64 (batch,)");
  const int64_t* rows = req_pool_indices.data_ptr<int64_t>();
  for (int64_t b = 0; b < req_pool_indices.numel(); ++b)
    TORCH_CHECK(rows[b] >= 0 && rows[b] < req_to_token.size(0), op, ": req_pool_indices out of range");
  return {q.data_ptr(),
          k_buffer.data_ptr(),
          v_buffer.data_ptr(),
          out.data_ptr(),
          req_to_token.data_ptr<int32_t>(),
          rows,
          q.stride(0),
          q.stride(1),
          out.stride(0),
          out.stride(1),
          k_buffer.stride(0),
          req_to_token.stride(0),
          static_cast<int>(kv_heads),
          static_cast<int>(heads / kv_heads)};
}
}  // namespace tandem_paged
