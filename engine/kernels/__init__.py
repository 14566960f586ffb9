"""The fused CPU kernels (csrc/), their per-instruction-set builds, and the CPU plan that picks them."""
