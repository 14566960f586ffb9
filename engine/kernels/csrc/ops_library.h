// The op namespace of one build. engine/cpu_build.py compiles one library per
// instruction-set level and names its ops torch.ops.tandem_cpu_<level>.* through
// -DTANDEM_OPS=tandem_cpu_<level>, so several levels load side by side in one process
// (the tests run every level the CPU can execute against the same references).
#pragma once

#include <torch/library.h>

#ifndef TANDEM_OPS
#define TANDEM_OPS tandem_cpu
#endif

// TORCH_LIBRARY* paste their namespace token (##): one more macro level expands
// TANDEM_OPS to the build's name before it is pasted.
#define TANDEM_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define TANDEM_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define TANDEM_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)
