"""Native model definitions (no transformers modeling code at run time)."""
