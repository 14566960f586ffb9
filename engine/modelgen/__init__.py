"""Building HF-format models locally: presets, weights, the byte-level BPE tokenizer."""
