// Work items handed out dynamically: an atomic counter inside one parallel region on
// torch's thread pool, so uneven items (sequence lengths, causal blocks) don't leave a
// thread idle. Header-only.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace tandem_par {
template <typename F>
void run_dynamic(int64_t n, const F& f) {
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), n));
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) f(i);
  });
}
}  // namespace tandem_par
