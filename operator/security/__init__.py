"""What InferenceService authors may not do through the operator, and the Secrets its pods read:
the operator-wide policy, the pod template allowlists, hardening after the merge, the PD key."""
