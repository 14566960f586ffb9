"""JSON Schemas a client sends (response_format, a tool's parameters, SGLang's json_schema): each
must be a schema under its own metaschema, so the engine is only ever asked to compile
something that means what the client wrote.

Two steps, cheap first. Parsing a body charges all of its schemas to one budget
(schema_budget.py: sizes, depth, nodes; the router stops there). The worker then checks each
against its metaschema in a thread (`check_off_loop`), bounded by that budget, before it
tokenizes anything; a schema text it has already passed costs a digest look-up, so agents that
resend the same tools pay once.

The engine compiles the text of `schema_text`: compact, non-ASCII kept, so one schema is
one text whatever the client's spacing was (the engine caches compiled grammars by text).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any

from jsonschema.exceptions import best_match

from tandem.protocol import limits as L
from tandem.protocol.metaschemas import metaschema_validator
from tandem.protocol.schema_budget import SchemaRefused, schema_text

# Names of the constraint kinds, as SGLang's sampling_params and the engine's SamplingParams spell them.
CONSTRAINT_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")

# (the field it came from, the schema, its text): what a request body lists for both steps.
Schemas = list[tuple[str, Any, str]]
__all__ = ["CONSTRAINT_KINDS", "Schemas", "ValidatedSchemas", "check_off_loop", "check_schema", "schema_text"]


def parse_schema_string(text: str, what: str) -> Any:
    """SGLang's json_schema field: a schema sent as a string."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # a string is not bounded in depth as a body is
        raise ValueError(f"{what} is not JSON: {str(exc)[:200]}") from None


def check_schema(schema: Any, what: str) -> None:
    """SchemaRefused (a 400) naming `what` when `schema` is not a schema under its metaschema."""
    try:
        error = best_match(metaschema_validator(schema).iter_errors(schema))
    except Exception as exc:  # e.g. a TypeError for a "$schema" that is an object
        error = exc
    if error is not None:
        message = getattr(error, "message", None) or str(error)
        raise SchemaRefused(what, f"is not a valid JSON Schema: {message[:500]}")


class ValidatedSchemas:
    """Digests of schema texts that passed, least recently used first. Only digests are kept
    (16 bytes each), so the count bounds the memory too."""

    def __init__(self, max_entries: int = L.SCHEMA_CACHE_ENTRIES) -> None:
        self.max_entries = max_entries
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()  # checks run on worker threads

    def check(self, schemas: Schemas) -> int:
        """Checks each schema not seen before; how many were checked."""
        checked = 0
        for what, schema, text in schemas:
            key = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
            with self._lock:
                if key in self._seen:
                    self._seen.move_to_end(key)
                    continue
            check_schema(schema, what)
            checked += 1
            with self._lock:
                self._seen[key] = None
                while len(self._seen) > self.max_entries:
                    self._seen.popitem(last=False)
        return checked


VALIDATED = ValidatedSchemas()


async def check_off_loop(schemas: Schemas, cache: ValidatedSchemas = VALIDATED) -> None:
    """The metaschema step, on a worker thread: the event loop serves other requests meanwhile."""
    if schemas:
        await asyncio.to_thread(cache.check, schemas)
