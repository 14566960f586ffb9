"""Engine subcommands of the `tandem` console script.

`tandem.cli` imports this module on every invocation (even `tandem operator ...`), so it
must not import torch or transformers at import time: each command imports what it needs
inside its function. model_builder is safe to import here; it defers those imports too.

One `_add_<command>` helper per subcommand; `register` only calls them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from typing import Any

from tandem.engine.modelgen.model_builder import ARCHITECTURES, PRESETS, ModelSpec


def register(sub: argparse._SubParsersAction) -> None:
    _add_make_model(sub)
    _add_generate(sub)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text offline with the Engine (same scheduler as the servers)")
    p.add_argument("--model", default="tiny", help="model directory or built-in preset (default: tiny)")
    p.add_argument("--prompt", action="append", help="prompt text; repeat for a batch")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stream", action="store_true", help="print tokens as they arrive (first prompt)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="any Engine option by its SGLang name, e.g. page_size=16 (repeatable)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="stderr log level (info shows the CPU plan and the model runner's sizing)")
    p.set_defaults(func=_generate)


def _parse_engine_args(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, _, raw = pair.partition("=")
        try:
            out[key.replace("-", "_")] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.replace("-", "_")] = raw
    return out


def _generate(args: argparse.Namespace) -> int:
    from tandem.engine.engine import Engine

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    prompts = args.prompt or ["def fibonacci(n):", "The scheduler batches requests"]
    sampling: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                                "top_p": args.top_p, "top_k": args.top_k}
    if args.seed is not None:
        sampling["seed"] = args.seed
    with Engine(args.model, **_parse_engine_args(args.engine_arg)) as eng:
        if args.chat:
            prompts = [eng.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                         add_generation_prompt=True) for p in prompts]
        if args.stream:
            for chunk in eng.generate_stream(prompts[0], sampling):
                print(chunk["text"], end="", flush=True)
            print()
            return 0
        for prompt, out in zip(prompts, eng.generate(prompts, sampling)):
            print(json.dumps({"prompt": prompt, **out}, ensure_ascii=False))
    return 0


def _add_make_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "make-model",
        help="build a random HF-format model directory locally (config, weights, tokenizer)",
        description="Start from --preset (or the 'tiny' shapes with --arch) and override any field.",
    )
    p.add_argument("--out", required=True, help="directory to create")
    p.add_argument("--preset", choices=sorted(PRESETS), help="start from this preset")
    p.add_argument("--arch", choices=sorted(ARCHITECTURES), help="required unless --preset is given")
    p.add_argument("--hidden", type=int, help="hidden_size")
    p.add_argument("--layers", type=int, help="num_layers")
    p.add_argument("--heads", type=int, help="num_heads")
    p.add_argument("--kv-heads", type=int, help="num_kv_heads")
    p.add_argument("--head-dim", type=int, help="default: hidden // heads when either is changed")
    p.add_argument("--intermediate", type=int, help="intermediate_size")
    p.add_argument("--vocab", type=int, help="vocab_size, special tokens included")
    p.add_argument("--max-position", type=int, help="max_position_embeddings")
    p.add_argument("--rope-theta", type=float)
    p.add_argument(
        "--rope-scaling", help='JSON, e.g. \'{"rope_type": "linear", "factor": 2.0}\'; "null" clears'
    )
    p.add_argument(
        "--tie", action=argparse.BooleanOptionalAction, default=None, help="tie lm_head to embeddings"
    )
    p.add_argument("--seed", type=int)
    p.add_argument("--dtype", choices=("float32", "bfloat16"))
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=_make_model)


# CLI flag (argparse dest) -> ModelSpec field.
_SPEC_FLAGS = {
    "arch": "arch",
    "hidden": "hidden_size",
    "layers": "num_layers",
    "heads": "num_heads",
    "kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "intermediate": "intermediate_size",
    "vocab": "vocab_size",
    "max_position": "max_position_embeddings",
    "rope_theta": "rope_theta",
    "tie": "tie_word_embeddings",
    "seed": "seed",
    "dtype": "dtype",
}


def spec_from_args(args: argparse.Namespace) -> ModelSpec:
    """The preset (or 'tiny' with --arch) with every given flag applied."""
    if args.preset is None and args.arch is None:
        raise ValueError("give --arch or --preset")
    base = PRESETS[args.preset or "tiny"]
    changes: dict[str, Any] = {
        spec_field: getattr(args, flag)
        for flag, spec_field in _SPEC_FLAGS.items()
        if getattr(args, flag) is not None
    }
    # A preset's explicit head_dim belongs to its own hidden/heads; re-derive it if those change.
    if ("hidden_size" in changes or "num_heads" in changes) and "head_dim" not in changes:
        changes["head_dim"] = None
    if args.rope_scaling is not None:
        changes["rope_scaling"] = json.loads(args.rope_scaling)
    return dataclasses.replace(base, **changes)


def _make_model(args: argparse.Namespace) -> int:
    from tandem.engine.modelgen.model_builder import build_model

    try:
        spec = spec_from_args(args)
        out = build_model(spec, args.out, overwrite=args.force)
    except (ValueError, FileExistsError) as exc:  # bad flags, or --out taken without --force
        print(f"tandem make-model: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({spec.arch}, {spec.param_count() / 1e6:.1f}M params)")
    return 0
