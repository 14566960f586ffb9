"""One ext-proc stream (one HTTP request through the gateway): messages in, answers out.

When the EPP can pick, and how it answers, follows the request body mode the gateway announces
in its first message (`protocol_config`; a gateway that announces none is taken to stream in
full duplex, GIE's mode):

    headers, end of stream (GET, no body)  -> pick now; headers answer: route
    FULL_DUPLEX_STREAMED (or unannounced)  -> hold the headers' answer and the body's pieces
                                              until the body ends; then the headers answer (route)
                                              and the body streamed back (the gateway forwards
                                              only what comes back)
    BUFFERED                               -> headers answered at once (continue); the whole
                                              body in one message; its answer carries the route
    STREAMED, NONE                         -> the body comes after the headers' answer, or never:
                                              pick on the headers (load alone)
    response headers, body, trailers       -> passed through (echoed in full duplex); the
                                              response's status feeds the worker's breaker

A route holds its workers' load and admission slots until the response ends or the stream
does (`close`, from the server whatever ends it: the gateway, a cancel, an error). Anything
out of order is a ProtocolError: the stream ends with INVALID_ARGUMENT and the gateway fails
that one request.
"""

from __future__ import annotations

import logging

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from tandem.router.epp import messages
from tandem.router.epp.picker import Pick, Picker
from tandem.web.errors import ApiError

log = logging.getLogger("tandem.router.epp")
Mode = processing_mode_pb2.ProcessingMode
FULL_DUPLEX, BUFFERED, BUFFERED_PARTIAL = Mode.FULL_DUPLEX_STREAMED, Mode.BUFFERED, Mode.BUFFERED_PARTIAL
MAX_HEADERS = 256  # request headers the EPP reads; past it the request is refused


class ProtocolError(Exception):
    """A message the ext-proc protocol does not allow here (the gateway's bug, or not a gateway)."""


class ExtProcStream:
    def __init__(self, picker: Picker, max_body: int) -> None:
        self.picker, self.max_body = picker, max_body
        self.request_mode: int | None = None  # None: not announced (taken as full duplex)
        self.response_mode = Mode.NONE
        self.started = False
        self.headers: dict[str, str] | None = None
        self.only: frozenset[str] | None = None
        self.body = bytearray()
        self.waiting = False  # the headers' answer is held for the body (full duplex)
        self.pick: Pick | None = None
        self.done = False  # answered for good (an immediate response): nothing more is read

    async def on(self, request: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if self.done:
            raise ProtocolError("a message after the request was answered")
        if not self.started:
            self.started = True
            if request.HasField("protocol_config"):
                self.request_mode = request.protocol_config.request_body_mode
                self.response_mode = request.protocol_config.response_body_mode
        kind = request.WhichOneof("request")
        try:
            if kind == "request_headers":
                return await self._request_headers(request)
            if kind == "request_body":
                return await self._request_body(request.request_body)
            if kind == "request_trailers":
                return await self._request_trailers()
        except ApiError as exc:
            self.done = True
            self.picker.state.metrics.epp_decisions.labels(str(exc.status)).inc()
            return [messages.immediate(exc.status, exc.body(), exc.message)]
        if self.pick is None and kind is not None and kind.startswith("response"):
            raise ProtocolError(f"{kind} before the request was routed")
        if kind == "response_headers":
            self._report(messages.header_map(request.response_headers))
            if request.response_headers.end_of_stream:
                self.close()
            return [messages.headers_answer(response=True)]
        if kind == "response_body":
            chunk = request.response_body
            if chunk.end_of_stream:
                self.close()
            if self.response_mode == FULL_DUPLEX:
                return list(messages.streamed_body(chunk.body, chunk.end_of_stream, response=True))
            return [messages.body_answer(response=True)]
        if kind == "response_trailers":
            self.close()
            return [messages.trailers_answer(response=True)]
        raise ProtocolError(f"unknown or empty ext-proc message ({kind})")

    def close(self) -> None:
        """Give back what the route holds (idempotent)."""
        if self.pick is not None:
            self.pick.release()

    # ---- the request ----------------------------------------------------------------------------
    async def _request_headers(self, request: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if self.headers is not None:
            raise ProtocolError("request headers twice")
        if len(request.request_headers.headers.headers) > MAX_HEADERS:
            raise ApiError(431, f"more than {MAX_HEADERS} request headers")
        self.headers = messages.header_map(request.request_headers)
        try:
            self.only = messages.subset_hint(request)
        except ValueError as exc:
            raise ApiError(503, f"the gateway's endpoint subset is malformed: {exc}") from None
        if request.request_headers.end_of_stream:
            return await self._answer_headers(None)
        if self.request_mode in (None, FULL_DUPLEX):
            self.waiting = True
            return []
        if self.request_mode in (BUFFERED, BUFFERED_PARTIAL):
            return [messages.headers_answer()]  # the route goes with the body's answer
        return await self._answer_headers(None)  # STREAMED, NONE: the body is not ours to wait for

    async def _request_body(self, chunk: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self.headers is None:
            raise ProtocolError("a request body before its headers")
        if self.pick is not None:  # STREAMED: routed on the headers, the body passes
            return [messages.body_answer()]
        if len(self.body) + len(chunk.body) > self.max_body:
            raise ApiError(413, f"the request body is over {self.max_body} bytes")
        self.body += chunk.body
        if not chunk.end_of_stream:
            if self.request_mode == BUFFERED_PARTIAL:  # the gateway's buffer is full: too big to route on
                raise ApiError(413, "the request body is larger than the gateway's buffer")
            return []
        return await self._body_ended(end=True)

    async def _request_trailers(self) -> list[pb.ProcessingResponse]:
        if self.headers is None:
            raise ProtocolError("request trailers before headers")
        if self.pick is None and self.waiting:  # the body ended with trailers instead of end_of_stream
            return [*await self._body_ended(end=False), messages.trailers_answer()]
        return [messages.trailers_answer()]

    async def _body_ended(self, end: bool) -> list[pb.ProcessingResponse]:
        body = bytes(self.body)
        self.body = bytearray()
        pick = await self._pick(body)
        common = messages.routing(pick.endpoint, pick.prefill, None if pick.body is None else len(pick.body),
                                  pick.headers)
        metadata = messages.destination_metadata(pick.endpoint)
        if self.waiting:  # full duplex: the held headers' answer, then the body as it should go on
            self.waiting = False
            return [messages.headers_answer(common, metadata),
                    *messages.streamed_body(body if pick.body is None else pick.body, end)]
        if pick.body is not None:
            common.body_mutation.body = pick.body
        return [messages.body_answer(common, metadata)]

    async def _answer_headers(self, body: bytes | None) -> list[pb.ProcessingResponse]:
        pick = await self._pick(body)
        common = messages.routing(pick.endpoint, pick.prefill, None, pick.headers)
        return [messages.headers_answer(common, messages.destination_metadata(pick.endpoint))]

    async def _pick(self, body: bytes | None) -> Pick:
        headers = self.headers or {}
        path = headers.get(":path", "/").split("?", 1)[0]
        self.pick = await self.picker.pick(headers.get(":method", ""), path, headers, body, self.only)
        self.picker.state.metrics.epp_decisions.labels("picked").inc()
        return self.pick

    def _report(self, headers: dict[str, str]) -> None:
        """The worker's answer status: its breaker counts a 5xx (a 429 is busy, not broken)."""
        status = headers.get(":status", "")
        if self.pick is not None and status.isdigit():
            self.pick.report(int(status))

