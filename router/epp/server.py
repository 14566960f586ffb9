"""The EPP's gRPC listener, in the router's own event loop: Envoy's ExternalProcessor service
and the gRPC health service with GIE's three names (liveness, readiness, the ext-proc service).

It shares everything with the HTTP front (workers, health checks, discovery, policies, load,
admission), so a router serves its own clients and a gateway's at once and balances them
together. Each message is capped at the router's request size (plus framing); a stream's
failure is that one request's: a protocol error ends it with INVALID_ARGUMENT, a bug with an
immediate 500.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem.router.epp import messages
from tandem.router.epp.picker import Picker
from tandem.router.epp.stream import ExtProcStream, ProtocolError
from tandem.router.routes import readiness
from tandem.web.errors import error_body

log = logging.getLogger("tandem.router.epp")
EXT_PROC_SERVICE = pb.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
LIVENESS, READINESS = "liveness", "readiness"
FRAMING = 64 * 1024  # a message's bytes beyond its body: headers, metadata


class EndpointPicker(pb_grpc.ExternalProcessorServicer):
    def __init__(self, picker: Picker, max_body: int) -> None:
        self.picker, self.max_body = picker, max_body

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],  # noqa: N802 (gRPC's name)
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        stream = ExtProcStream(self.picker, self.max_body)
        try:
            async for request in request_iterator:
                try:
                    answers = await stream.on(request)
                except ProtocolError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                except Exception as exc:  # a bug: this request fails, the listener goes on
                    log.exception("endpoint picker: unhandled error")
                    message = f"internal error: {type(exc).__name__}"
                    stream.done = True
                    answers = [messages.immediate(500, error_body(500, message), message)]
                for answer in answers:
                    yield answer
        finally:
            stream.close()


def ready(state: Any) -> bool:
    """What the router's /health/ready says, for the readiness and ext-proc health names."""
    return readiness(state) is None


class EppListener:
    def __init__(self, state: Any, host: str, port: int, fallbacks: int, max_body: int) -> None:
        self.state = state
        limit = max_body + FRAMING
        self.server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit),
                                               ("grpc.max_send_message_length", limit)])
        pb_grpc.add_ExternalProcessorServicer_to_server(EndpointPicker(Picker(state, fallbacks), max_body),
                                                        self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"{_bracket(host)}:{port}")
        self._task: asyncio.Task | None = None

    async def start(self, interval: float) -> None:
        await self.server.start()
        await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self._update()
        self._task = asyncio.create_task(self._watch(interval))
        log.info("endpoint picker (ext-proc) listening on port %d", self.port)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace=1.0)

    async def _watch(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            await self._update()

    async def _update(self) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if ready(self.state)
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in (READINESS, EXT_PROC_SERVICE):
            await self.health.set(name, status)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
