"""Model generations and the ratio-preserving rollout between them: the generation hash, the pure
step, and the worker Deployments grouped by generation with the API calls that scale old ones."""
