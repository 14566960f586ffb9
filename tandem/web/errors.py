"""Every failure leaves the server as OpenAI's error JSON with the right status:

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

Bad input is 400 (never 500), an unknown path 404, a missing or wrong key 401, a
full admission queue 429, a draining or dead worker 503, a role that cannot do the
call yet 501. A 500 means a bug in this server.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error",
          501: "not_implemented_error", 503: "service_unavailable_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict:
        return error_body(self.status, self.message, self.code, self.param)


def bad_request(message: str, code: str | None = None, param: str | None = None) -> ApiError:
    return ApiError(400, message, code, param)


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param,
                      "code": code if code is not None else status}}


def error_response(status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    e = errs[0]
    # Union members show up in the location as type tags (prompt.str, prompt.list[int]): drop them.
    loc = [str(x) for x in e.get("loc", ()) if x != "body" and not _is_type_tag(str(x))]
    if e.get("type") == "json_invalid":
        return f"the body is not valid JSON: {e.get('msg')}", None
    where = ".".join(loc)
    return (f"{where}: {e.get('msg')}" if where else str(e.get("msg"))), (where or None)


def _is_type_tag(part: str) -> bool:
    return "[" in part or part in {"str", "int", "float", "bool", "dict", "list"} or part.startswith("function-")


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(400, message, "invalid_request", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}")
