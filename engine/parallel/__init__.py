"""Tensor parallelism: the weight split (shard.py), the ranks' process group (group.py), and
what keeps the ranks' schedulers in step (tick.py, digest.py). docs/tp.md draws it."""
