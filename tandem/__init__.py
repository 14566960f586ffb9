"""Tandem: disaggregated LLM serving.

`from tandem import Engine` is resolved lazily so that torch-free components
(router, operator) can import `tandem.*` without pulling torch in.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from tandem.engine.engine import Engine

        return Engine
    raise AttributeError(name)
