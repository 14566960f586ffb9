"""Ext-proc messages in and out: GIE's names, and builders for every answer the EPP sends.

What GIE's Endpoint Picker Protocol fixes (docs/proposals/004-endpoint-picker-protocol):
- the picked endpoints go out twice, with the same value: the request header
  `x-gateway-destination-endpoint` and dynamic metadata `envoy.lb` / that key ("ip:port", or a
  comma-separated list whose first entry is the primary and the rest fallbacks);
- the gateway may narrow the choice with filter metadata `envoy.lb.subset_hint` /
  `x-gateway-destination-endpoint-subset` (a list of "ip:port"); nothing eligible in it is a 503;
- no endpoint is an ImmediateResponse 503, a request shed under load a 429.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

DESTINATION = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
SUBSET = "x-gateway-destination-endpoint-subset"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SERVED = "x-gateway-destination-endpoint-served"
# PD: the prefill worker paired with the picked decode worker, as llm-d's routing sidecar reads it.
PREFILLER = "x-prefiller-host-port"
# Never forwarded as a client sent them: the EPP sets or removes each on every request.
OWNED_HEADERS = (DESTINATION, PREFILLER)
BODY_CHUNK = 64 * 1024  # a streamed body goes back in pieces well under gRPC's 4 MiB message cap
MAX_SUBSET = 4096  # endpoints in a subset hint: one InferencePool's pods, with room to spare


def header_map(headers: pb.HttpHeaders) -> dict[str, str]:
    """Lower-case name -> value (raw_value, which Envoy sends, else value); a repeated name keeps
    its first value, as the router's HTTP front does."""
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        value = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        out.setdefault(h.key.lower(), value)
    return out


def subset_hint(request: pb.ProcessingRequest) -> frozenset[str] | None:
    """The gateway's subset of "ip:port" endpoints, None when it sent none. ValueError: a hint
    that is not a list of strings, or an implausibly long one."""
    md = request.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in md or SUBSET not in md[SUBSET_NAMESPACE].fields:
        return None
    value = md[SUBSET_NAMESPACE].fields[SUBSET]
    if value.WhichOneof("kind") != "list_value":
        raise ValueError(f"{SUBSET} must be a list of ip:port")
    items = value.list_value.values
    if len(items) > MAX_SUBSET or any(v.WhichOneof("kind") != "string_value" for v in items):
        raise ValueError(f"{SUBSET} must be a list of at most {MAX_SUBSET} ip:port strings")
    return frozenset(v.string_value for v in items)


def header_option(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def routing(endpoints: str, prefill: str | None, body_length: int | None,
            extra: dict[str, str]) -> pb.CommonResponse:
    """The request's routing: the destination (and the PD prefill) headers set, any client copy of
    them replaced or removed, the route cache cleared so the gateway routes on them; a replaced
    body's length where the body changed; `extra` headers set as well (the workers' key)."""
    sets = [header_option(DESTINATION, endpoints), *(header_option(k, v) for k, v in extra.items())]
    removes = []
    if prefill is not None:
        sets.append(header_option(PREFILLER, prefill))
    else:
        removes.append(PREFILLER)
    if body_length is not None:
        sets.append(header_option("content-length", str(body_length)))
    return pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=sets, remove_headers=removes),
                             clear_route_cache=True)


def destination_metadata(endpoints: str) -> struct_pb2.Struct:
    md = struct_pb2.Struct()
    md.update({DESTINATION_NAMESPACE: {DESTINATION: endpoints}})
    return md


def _answer(kind: str, answer: Any, metadata: struct_pb2.Struct | None) -> pb.ProcessingResponse:
    kw: dict[str, Any] = {kind: answer}
    if metadata is not None:
        kw["dynamic_metadata"] = metadata
    return pb.ProcessingResponse(**kw)


def headers_answer(common: pb.CommonResponse | None = None, metadata: struct_pb2.Struct | None = None,
                   response: bool = False) -> pb.ProcessingResponse:
    return _answer("response_headers" if response else "request_headers",
                   pb.HeadersResponse(response=common or pb.CommonResponse()), metadata)


def body_answer(common: pb.CommonResponse | None = None, metadata: struct_pb2.Struct | None = None,
                response: bool = False) -> pb.ProcessingResponse:
    return _answer("response_body" if response else "request_body",
                   pb.BodyResponse(response=common or pb.CommonResponse()), metadata)


def streamed_body(body: bytes, end: bool, response: bool = False) -> Iterator[pb.ProcessingResponse]:
    """A body sent back in full-duplex streamed mode, where the gateway forwards only what the
    processor returns: in pieces, the last one marked as the end when `end`."""
    pieces = [body[i:i + BODY_CHUNK] for i in range(0, len(body), BODY_CHUNK)] or [b""]
    for i, piece in enumerate(pieces):
        last = end and i == len(pieces) - 1
        mutation = pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=piece, end_of_stream=last))
        yield body_answer(pb.CommonResponse(body_mutation=mutation), response=response)


def trailers_answer(response: bool = False) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(**{"response_trailers" if response else "request_trailers": pb.TrailersResponse()})


def immediate(status: int, body: dict[str, Any], details: str) -> pb.ProcessingResponse:
    """An answer to the client from the gateway itself (no endpoint, a bad request, shed), with
    the same OpenAI error JSON the router's HTTP front sends."""
    content = json.dumps(body, separators=(",", ":")).encode()
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),
        headers=pb.HeaderMutation(set_headers=[header_option("content-type", "application/json")]),
        body=content, details=details[:200]))
