"""The `tandem` console script.

Each component owns its subcommands: it exposes `register(subparsers)` in its
own `cli.py`, and is imported only when the console script starts, so that
`tandem operator ...` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that contribute subcommands; each defines register(subparsers).
_COMMAND_MODULES = (
    "tandem.engine.cli",
    "tandem.engine.modelgen.cli",
    "tandem.operator.cli",
    "tandem.server.cli",
    "tandem.router.cli",
    "tandem.local.cli",
    "tandem.loadgen.cli",
)


# Third-party packages that only some extras install.
_OPTIONAL = {"httpx", "torch", "kopf", "kubernetes", "transformers", "fastapi", "uvicorn", "pydantic"}


def build_parser(modules: tuple[str, ...] = _COMMAND_MODULES) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # A component whose extra is not installed simply contributes no commands.
            if exc.name and exc.name.split(".")[0] in _OPTIONAL:
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
