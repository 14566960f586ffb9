"""Models on disk: what `--model` names (resolve), GGUF imports, named real models fetched from
the package index, and presets built locally with random weights."""
