"""The decode role: the scheduler plus a KV receiver (`receiver`, one `Incoming` per request),
the prefill peers it may talk to (`allowlist`, `peers`) and the arrival of their KV
(`arrival`). What it shares with prefill is in `tandem.pd` (docs/pd.md)."""
