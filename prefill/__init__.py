"""The prefill role: the scheduler plus a KV sender (`sender`, one `Outgoing` per request),
bound to the bootstrap port. What it shares with decode is in `tandem.pd` (docs/pd.md)."""
