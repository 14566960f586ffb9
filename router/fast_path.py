"""The proxied routes as plain ASGI, in front of FastAPI.

Every request through the router pays for its per-request machinery (dependency solving,
body re-reads, exception middleware, a task per disconnect watch); on the proxied routes
that was about half of the router's CPU per request, and on a small machine CPU is
latency. Here a POST to /v1/completions, /v1/chat/completions or /generate is read once,
parsed once (tandem/web/json_body.py: anything a worker could choke on is a 400 here),
stripped of the fields only the router sets (routes.ROUTER_FIELDS), validated with the same
pydantic models, turned into a Job by the same builders (routes.py) and answered with the
same error JSON; everything else (health, metrics, models, admin) falls through to FastAPI.

The client's bytes go to the worker as they came only when the body the worker gets is the
one they encode: no field stripped, nothing replaced by a builder.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tandem.router import routes
from tandem.web.errors import ApiError, error_response, validation_message
from tandem.web.json_body import parse_json

log = logging.getLogger("tandem.router")


class FastPath:
    def __init__(self, app: Any, owner: Any) -> None:
        self.app = app  # the rest of the stack: FastAPI's routes
        self.owner = owner  # the FastAPI app, whose lifespan sets state.router

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        entry = routes.PROXIED.get(scope["path"]) if scope["type"] == "http" else None
        if entry is None or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        request = Request(scope, receive)
        response = await self._answer(request, *entry)
        await response(scope, receive, send)

    async def _answer(self, request: Request, model: Any, build: Any) -> Response:
        state = self.owner.state.router
        try:
            data = await request.body()
            raw = parse_json(data)
            stripped = routes.strip_router_fields(raw)
            body = model.model_validate(raw)
            job = await build(state, body, raw)
            if job.body is raw and not stripped:
                job.raw = data  # forwarded as it came: no second encoding
            return await routes.run(request, state, job)
        except ValidationError as exc:
            message, param = validation_message(RequestValidationError(exc.errors()))
            return error_response(400, message, "invalid_request", param)
        except ApiError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        except Exception as exc:  # a bug here: answered like FastAPI's handler answers one
            log.exception("unhandled error")
            return error_response(500, f"internal error: {type(exc).__name__}")
