"""`python -m tandem.operator render|run|crd`: the operator commands without the rest of the CLI."""

from __future__ import annotations

import argparse
import sys

from tandem.operator.cli import register


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.operator")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["operator", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
