"""KV memory: the pools, the page allocator, the prefix caches, and the manager over them."""
