"""The grammar-backend seam: what the scheduler and the sampler need of a structured-output
library, so a second one (llguidance) is one more file and one entry in registry.py.

A backend compiles a constraint once (the compile is the slow part, and it runs in a child
process that can be killed: compile_pool.py); each request then gets its own cheap matcher
over the compiled grammar. The matcher is advanced with every token the request keeps, and
fills that request's row of a batch's vocabulary mask before the next token is sampled.

The child rebuilds a compile-only backend from `spec()` (registry.create_from_spec), and
hands each compiled grammar back as `serialize()`'s text, which `deserialize()` reads here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


class GrammarError(ValueError):
    """A constraint that cannot be compiled: the request fails with this message (a 400)."""

    status = 400


class Matcher(Protocol):
    def accept(self, token: int) -> bool:
        """Advance by one token; False if the grammar does not allow it (state unchanged)."""
        ...

    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `mask[row]` (the backend's mask format)."""
        ...

    def is_terminated(self) -> bool:
        """The grammar has accepted its stop token: nothing may follow."""
        ...


class GrammarBackend(ABC):
    @abstractmethod
    def compile(self, kind: str, text: str) -> Any:
        """Compile one constraint (kind: json_schema | regex | ebnf | structural_tag); raise
        GrammarError naming the problem. Called on a worker thread, never the scheduler's."""

    @abstractmethod
    def matcher(self, compiled: Any) -> Matcher: ...

    @abstractmethod
    def spec(self) -> str:
        """What a child process needs to build this backend for compiling (registry.py)."""

    @abstractmethod
    def serialize(self, compiled: Any) -> str: ...

    @abstractmethod
    def deserialize(self, data: str) -> Any:
        """What serialize gave, as a compiled grammar of this backend's vocabulary."""

    @abstractmethod
    def size_bytes(self, compiled: Any) -> int:
        """The memory a compiled grammar holds: the cache is bounded by it."""

    @abstractmethod
    def allocate_mask(self, rows: int) -> torch.Tensor:
        """A host mask for `rows` rows that allows every token until a row is filled."""

    @abstractmethod
    def apply_mask(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        """Set the logits of disallowed tokens to -inf, in place, on the logits' device."""
