// Dtype and head_dim dispatch shared by the CPU kernels: a tensor's dtype becomes a tag
// value (float or c10::BFloat16), a head_dim becomes NV = head_dim / 16 vector lanes as a
// compile-time int. The head_dims listed are cpu_kernels.SUPPORTED_HEAD_DIMS.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <type_traits>

namespace tandem_dispatch {
template <typename F>
void by_dtype(const at::Tensor& t, const char* op, const F& f) {
  if (t.scalar_type() == at::kFloat) return f(float{});
  if (t.scalar_type() == at::kBFloat16) return f(c10::BFloat16{});
  TORCH_CHECK(false, op, ": float32 or bfloat16 only, got ", t.scalar_type());
}

inline bool supported_head_dim(int64_t dim) {
  return dim == 32 || dim == 64 || dim == 96 || dim == 128 || dim == 256;
}

template <typename F>
void by_head_dim(int64_t dim, const char* op, const F& f) {
  switch (dim) {
    case 32: return f(std::integral_constant<int, 2>{});
    case 64: return f(std::integral_constant<int, 4>{});
    case 96: return f(std::integral_constant<int, 6>{});
    case 128: return f(std::integral_constant<int, 8>{});
    case 256: return f(std::integral_constant<int, 16>{});
    default: TORCH_CHECK(false, op, ": unsupported head_dim ", dim);
  }
}
}  // namespace tandem_dispatch
