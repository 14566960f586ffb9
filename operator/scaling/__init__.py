"""Replica counts per role: the built-in autoscaler (metrics, signals, the pure decision), the P:D
ratio, the RoleScaler objects external autoscalers drive, and which pods a scale-down removes."""
