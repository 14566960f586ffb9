"""The children rendered from a ServiceSpec, as pure functions: worker and router Deployments, the
engine ConfigMap, Services, PodDisruptionBudgets, the NetworkPolicy and the metadata they share."""
