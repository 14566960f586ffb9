// Fused elementwise ops of a decoder layer for CPU (loaded by engine/cpu_kernels.py).
//
// Each op is one pass over its rows where the torch path is 3-8 ops, each a full pass
// over memory plus a dispatch (~5-20 us apiece at decode sizes). They round to the
// activation dtype exactly where the torch/HF chain of ops does, so bf16 results match
// the torch path bit for bit except where an fp32 reduction order differs:
//
//   rms_norm(out, x, w):              out = T(w * T(x * rsqrt(mean(x^2) + eps)))
//   fused_add_rms_norm(x, res, w):    res = T(res + x);  x = rms_norm(res)        (in place)
//   silu_and_mul(out, gu):            out = T(T(silu(g)) * u),  gu = [g | u] per row
//   rope_qk(qkv, pos, cos, sin, ...): per q and k head of each token, in place:
//                                     [qk-norm:] h = rms_norm(h, w_q or w_k)
//                                     h = T(T(h * c) + T(rotate_half(h) * s)),  c = T(cos[pos])
//   store_kv(kb, vb, loc, k, v):      kb[loc[i]] = k[i], vb[loc[i]] = v[i]: the layer's KV write,
//                                     one call for both (two index_copy_ were ~45 us each at decode)
//
// T() is rounding to the activation dtype (identity in fp32). Rows need a contiguous
// last dim; dims must be multiples of 16 (head_dim of 32) -- cpu_kernels.py checks.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include "ops_library.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "dispatch.h"
#include "entry_points.h"
#include "vec16.h"

namespace {

using namespace tandem_vec;
using tandem_dispatch::by_dtype;

// rows per task: about 16k elements, so a decode-sized call stays on one thread
inline int64_t grain(int64_t dim) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(dim, 1)); }

template <typename T>
inline float inv_rms(const T* x, int dim, float eps) {
  V16 ss = vzero();
  for (int i = 0; i < dim; i += 16) {
    const V16 v = vload(x + i);
    ss = vfma(v, v, ss);
  }
  return 1.f / std::sqrt(vsum(ss) / static_cast<float>(dim) + eps);
}

// out = T(w * T(x * r)); out may alias x
template <typename T>
inline void norm_row(T* out, const T* x, const T* w, int dim, float eps) {
  const V16 r = vset1(inv_rms(x, dim, eps));
  for (int i = 0; i < dim; i += 16) vstore(out + i, vmul(vload(w + i), vround<T>(vmul(vload(x + i), r))));
}

template <typename T>
void rms_norm_impl(const at::Tensor& out, const at::Tensor& x, const at::Tensor& w, float eps) {
  const int64_t rows = x.size(0), dim = x.size(1), xs = x.stride(0), os = out.stride(0);
  T* o = out.data_ptr<T>();
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  at::parallel_for(0, rows, grain(dim), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(o + r * os, xp + r * xs, wp, static_cast<int>(dim), eps);
  });
}

template <typename T>
void add_rms_norm_impl(const at::Tensor& x, const at::Tensor& res, const at::Tensor& w, float eps) {
  const int64_t rows = x.size(0), dim = x.size(1), xs = x.stride(0), rs = res.stride(0);
  T* xp = x.data_ptr<T>();
  T* rp = res.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  at::parallel_for(0, rows, grain(dim), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* xr = xp + r * xs;
      T* rr = rp + r * rs;
      for (int i = 0; i < dim; i += 16) vstore(rr + i, vadd(vload(rr + i), vload(xr + i)));
      norm_row(xr, rr, wp, static_cast<int>(dim), eps);
    }
  });
}

template <typename T>
void silu_and_mul_impl(const at::Tensor& out, const at::Tensor& gu) {
  const int64_t rows = out.size(0), dim = out.size(1), gs = gu.stride(0), os = out.stride(0);
  T* o = out.data_ptr<T>();
  const T* g = gu.data_ptr<T>();
  const V16 one = vset1(1.f);
  at::parallel_for(0, rows, grain(2 * dim), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* gr = g + r * gs;
      T* orow = o + r * os;
      for (int64_t i = 0; i < dim; i += 16) {
        const V16 x = vload(gr + i);
        const V16 silu = vround<T>(vdiv(x, vadd(one, vexp(vsub(vzero(), x)))));
        vstore(orow + i, vmul(silu, vload(gr + dim + i)));
      }
    }
  });
}

// One head in place: optional qk-norm, then neox RoPE with this token's c, s (rounded to T).
// The tables are fp32 or already T (a model cast to bf16 casts its buffers too).
template <typename T, typename C>
inline void rope_head(T* h, const C* cos, const C* sin, const T* norm_w, int dim, float eps) {
  if (norm_w != nullptr) norm_row(h, h, norm_w, dim, eps);
  const int half = dim / 2;
  for (int i = 0; i < half; i += 16) {
    const V16 x1 = vload(h + i), x2 = vload(h + half + i);
    const V16 c1 = vround<T>(vload(cos + i)), s1 = vround<T>(vload(sin + i));
    const V16 c2 = vround<T>(vload(cos + half + i)), s2 = vround<T>(vload(sin + half + i));
    vstore(h + i, vsub(vround<T>(vmul(x1, c1)), vround<T>(vmul(x2, s1))));
    vstore(h + half + i, vadd(vround<T>(vmul(x2, c2)), vround<T>(vmul(x1, s2))));
  }
}

template <typename T, typename C>
void rope_qk_impl(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                  const at::Tensor& sin, const at::Tensor& q_w, const at::Tensor& k_w, int hq, int hkv,
                  int dim, float eps) {
  const int64_t tokens = qkv.size(0), ts = qkv.stride(0), tab = cos.stride(0);
  T* base = qkv.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const C* cp = cos.data_ptr<C>();
  const C* sp = sin.data_ptr<C>();
  const T* qw = q_w.defined() && q_w.numel() ? q_w.data_ptr<T>() : nullptr;
  const T* kw = k_w.defined() && k_w.numel() ? k_w.data_ptr<T>() : nullptr;
  at::parallel_for(0, tokens, grain((hq + hkv) * dim), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      T* row = base + t * ts;  // q heads, then k heads; v is left alone
      const C* c = cp + pos[t] * tab;
      const C* s = sp + pos[t] * tab;
      for (int h = 0; h < hq; ++h) rope_head(row + h * dim, c, s, qw, dim, eps);
      for (int h = 0; h < hkv; ++h) rope_head(row + (hq + h) * dim, c, s, kw, dim, eps);
    }
  });
}

void check_rows(const at::Tensor& t, int64_t dim, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.size(1) == dim && t.stride(1) == 1, what,
              " must be a CPU (rows, ", dim, ") tensor with a contiguous last dim");
  TORCH_CHECK(dim % 16 == 0, what, ": the last dim must be a multiple of 16");
}

void check_weight(const at::Tensor& w, const at::Tensor& like, int64_t dim) {
  TORCH_CHECK(w.is_contiguous() && w.numel() == dim && w.scalar_type() == like.scalar_type(),
              "norm weight must be contiguous, of the activation dtype, with ", dim, " elements");
}

}  // namespace

namespace tandem_entry {

void rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, x.size(1), "x");
  check_rows(out, x.size(1), "out");
  TORCH_CHECK(out.size(0) == x.size(0) && out.scalar_type() == x.scalar_type(), "out must match x");
  check_weight(w, x, x.size(1));
  by_dtype(x, "rms_norm", [&](auto tag) { rms_norm_impl<decltype(tag)>(out, x, w, static_cast<float>(eps)); });
}

void fused_add_rms_norm(const at::Tensor& x, const at::Tensor& res, const at::Tensor& w, double eps) {
  check_rows(x, x.size(1), "x");
  check_rows(res, x.size(1), "residual");
  TORCH_CHECK(res.size(0) == x.size(0) && res.scalar_type() == x.scalar_type(), "residual must match x");
  check_weight(w, x, x.size(1));
  by_dtype(x, "fused_add_rms_norm",
           [&](auto tag) { add_rms_norm_impl<decltype(tag)>(x, res, w, static_cast<float>(eps)); });
}

void silu_and_mul(const at::Tensor& out, const at::Tensor& gu) {
  check_rows(out, out.size(1), "out");
  check_rows(gu, 2 * out.size(1), "gate_up");
  TORCH_CHECK(gu.size(0) == out.size(0) && gu.scalar_type() == out.scalar_type(), "gate_up must match out");
  by_dtype(out, "silu_and_mul", [&](auto tag) { silu_and_mul_impl<decltype(tag)>(out, gu); });
}

void rope_qk(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
             const at::Tensor& q_norm_w, const at::Tensor& k_norm_w, int64_t hq, int64_t hkv, int64_t dim,
             double eps) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) >= (hq + hkv) * dim,
              "qkv must be a CPU (tokens, >= (hq + hkv) * dim) tensor with a contiguous last dim");
  TORCH_CHECK(dim % 32 == 0, "rope_qk: head_dim must be a multiple of 32");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == qkv.size(0),
              "positions must be contiguous int64 (tokens,)");
  TORCH_CHECK((cos.scalar_type() == at::kFloat || cos.scalar_type() == qkv.scalar_type()) && cos.dim() == 2 &&
                  cos.size(1) == dim && cos.stride(1) == 1 && sin.sizes() == cos.sizes() &&
                  sin.strides() == cos.strides() && sin.scalar_type() == cos.scalar_type(),
              "cos/sin must be (max_positions, head_dim) tables in float32 or the qkv dtype");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.numel(); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rope_qk: position ", pos[t], " outside the table");
  for (const auto* w : {&q_norm_w, &k_norm_w})
    if (w->defined() && w->numel()) check_weight(*w, qkv, dim);
  by_dtype(qkv, "rope_qk", [&](auto tag) {
    using T = decltype(tag);
    const auto go = [&](auto ctag) {
      rope_qk_impl<T, decltype(ctag)>(qkv, positions, cos, sin, q_norm_w, k_norm_w, static_cast<int>(hq),
                                      static_cast<int>(hkv), static_cast<int>(dim), static_cast<float>(eps));
    };
    if (cos.scalar_type() == at::kFloat) return go(float{});
    return go(T{});
  });
}

void store_kv(const at::Tensor& k_buffer, const at::Tensor& v_buffer, const at::Tensor& loc, const at::Tensor& k,
              const at::Tensor& v) {
  TORCH_CHECK(k_buffer.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "store_kv is CPU-only");
  TORCH_CHECK(k_buffer.dim() == 3 && v_buffer.sizes() == k_buffer.sizes() && k_buffer.strides() == v_buffer.strides(),
              "store_kv: k/v buffers must be (slots, kv_heads, dim), alike");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(1) == k_buffer.size(1) && k.size(2) == k_buffer.size(2),
              "store_kv: k/v must be (tokens, kv_heads, dim) of the buffers' heads and dim");
  const int64_t row = k.size(1) * k.size(2), n = loc.numel();
  for (const at::Tensor* t : {&k_buffer, &k, &v})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "store_kv: each token's (kv_heads, dim) must be contiguous");
  TORCH_CHECK(k.scalar_type() == k_buffer.scalar_type() && v.scalar_type() == k.scalar_type() &&
                  v_buffer.scalar_type() == k.scalar_type(), "store_kv: one dtype for k, v and the buffers");
  TORCH_CHECK(loc.scalar_type() == at::kLong && loc.is_contiguous() && k.size(0) == n,
              "store_kv: loc must be contiguous int64, one slot per token");
  const int64_t* lp = loc.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(lp[i] >= 0 && lp[i] < k_buffer.size(0), "store_kv: slot out of range");
  const int64_t es = k.element_size(), bytes = row * es, bs = k_buffer.stride(0) * es;
  auto* kb = static_cast<char*>(k_buffer.data_ptr());
  auto* vb = static_cast<char*>(v_buffer.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  const int64_t ks = k.stride(0) * es, vs = v.stride(0) * es;
  // ~64 KB per task: a decode-sized write stays on the calling thread
  at::parallel_for(0, n, std::max<int64_t>(1, 65536 / bytes), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      std::memcpy(kb + lp[i] * bs, kp + i * ks, bytes);
      std::memcpy(vb + lp[i] * bs, vp + i * vs, bytes);
    }
  });
}

}  // namespace tandem_entry

TANDEM_LIBRARY_FRAGMENT(TANDEM_OPS, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def(
      "rope_qk(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, Tensor q_norm_weight, "
      "Tensor k_norm_weight, int num_q_heads, int num_kv_heads, int head_dim, float eps) -> ()");
  m.def("store_kv(Tensor(a!) k_buffer, Tensor(b!) v_buffer, Tensor loc, Tensor k, Tensor v) -> ()");
}

TANDEM_LIBRARY_IMPL(TANDEM_OPS, CPU, m) {
  m.impl("rms_norm", &tandem_entry::rms_norm);
  m.impl("fused_add_rms_norm", &tandem_entry::fused_add_rms_norm);
  m.impl("silu_and_mul", &tandem_entry::silu_and_mul);
  m.impl("rope_qk", &tandem_entry::rope_qk);
  m.impl("store_kv", &tandem_entry::store_kv);
}
