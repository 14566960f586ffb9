"""The router as a gateway's Endpoint Picker (EPP): Envoy's ext-proc protocol over gRPC, as the
Gateway API Inference Extension specifies it (its proposal 004), beside the router's HTTP front.

    Envoy (any GIE gateway) --ext-proc stream per HTTP request--> server.py
        stream.py    one stream: headers, body, trailers in; when to answer, in which body mode
        picker.py    the body -> a Job (the router's own validation and tokenizing) -> a route,
                     from the router's policies (cache-aware, load, PD pairing); load held until
                     the stream ends
        messages.py  the ext-proc answers: the destination header and dynamic metadata, the
                     PD prefill header, immediate error responses

The gateway, not the router, carries the bytes: the EPP only decides. For PD the destination is
the decode worker, and the paired prefill worker travels in `x-prefiller-host-port` (llm-d's
routing-sidecar convention); a Tandem decode worker reads it and drives the prefill itself
(tandem/server/prefiller_header.py).
"""
