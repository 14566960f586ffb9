"""A gateway's side of Envoy's ext-proc protocol, for tests: Envoy's own protos over real gRPC
(the messages Envoy sends, built with its generated classes), and readers of the answers."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import json_format, struct_pb2

Mode = processing_mode_pb2.ProcessingMode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def headers(method: str, path: str, eos: bool, extra: dict[str, str] | None = None,
            mode: int | None = Mode.FULL_DUPLEX_STREAMED, subset: list[str] | None = None) -> pb.ProcessingRequest:
    pairs = {":method": method, ":path": path, ":authority": "gw", ":scheme": "http",
             "content-type": "application/json", **(extra or {})}
    values = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    req = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=values),
                                                              end_of_stream=eos))
    if mode is not None:
        req.protocol_config.request_body_mode = mode
        req.protocol_config.response_body_mode = mode
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        req.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return req


def body(data: bytes, eos: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=eos))


def response_headers(status: int = 200, eos: bool = False) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=str(status).encode())]),
        end_of_stream=eos))


def response_body(data: bytes, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=eos))


def trailers() -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_trailers=pb.HttpTrailers())


class Stream:
    """One ext-proc stream: write what a gateway would, read the answers (each within `timeout`)."""

    def __init__(self, target: str, timeout: float = 10.0) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        self.call = pb_grpc.ExternalProcessorStub(self.channel).Process()
        self.timeout = timeout
        self._pending: asyncio.Future | None = None

    async def send(self, *requests: pb.ProcessingRequest) -> None:
        for r in requests:
            await self.call.write(r)

    async def read(self, n: int = 1) -> list[pb.ProcessingResponse]:
        out = []
        for _ in range(n):
            if self._pending is not None:  # a read started by nothing_within
                task, self._pending = self._pending, None
                out.append(await asyncio.wait_for(task, self.timeout))
            else:
                out.append(await asyncio.wait_for(self.call.read(), self.timeout))
        return out

    async def nothing_within(self, seconds: float) -> bool:
        """No answer comes within `seconds` (the EPP is holding its answer); a later read gets it."""
        self._pending = asyncio.ensure_future(self.call.read())
        done, _ = await asyncio.wait({self._pending}, timeout=seconds)
        return not done

    async def close(self) -> grpc.StatusCode:
        await self.call.done_writing()
        try:
            await asyncio.wait_for(self._pending or self.call.read(), self.timeout)
        except grpc.aio.AioRpcError:
            pass
        code = await asyncio.wait_for(self.call.code(), self.timeout)
        await self.channel.close()
        return code

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.call.cancel()
        await self.channel.close()


def mutation(common: pb.CommonResponse) -> tuple[dict[str, str], list[str]]:
    """(headers set, headers removed) by a CommonResponse."""
    sets = {o.header.key: (o.header.raw_value.decode() if o.header.raw_value else o.header.value)
            for o in common.header_mutation.set_headers}
    return sets, list(common.header_mutation.remove_headers)


def metadata(answer: pb.ProcessingResponse) -> dict[str, Any]:
    return json_format.MessageToDict(answer.dynamic_metadata)


def streamed(answers: list[pb.ProcessingResponse]) -> tuple[bytes, bool]:
    """The body a run of full-duplex body answers sends on, and whether the last one ends it."""
    pieces = [a.request_body.response.body_mutation.streamed_response for a in answers]
    return b"".join(p.body for p in pieces), bool(pieces) and pieces[-1].end_of_stream


def immediate(answer: pb.ProcessingResponse) -> tuple[int, dict[str, Any]]:
    r = answer.immediate_response
    return r.status.code, json.loads(r.body)
