"""The worker's metaschema step: a route awaits it after the body parses (the schemas' budget
is charged then) and before it tokenizes, so a schema that is not one is a 400 that cost no
prompt work, and the check itself runs on a thread (protocol/schema_check.py). The router
leaves this step to the worker: each request's schemas are checked once."""

from __future__ import annotations

from tandem.protocol.schema_budget import SchemaRefused
from tandem.protocol.schema_check import Schemas, check_off_loop
from tandem.web.errors import bad_request


async def check_schemas(schemas: Schemas) -> None:
    try:
        await check_off_loop(schemas)
    except SchemaRefused as exc:
        raise bad_request(str(exc), code="invalid_schema", param=exc.param) from None
