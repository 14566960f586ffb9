"""The HTTP pieces the worker server (`tandem serve`) and the router (`tandem router`) share,
so that neither reaches into the other:

    errors.py           OpenAI error JSON for every failure (ApiError and the handlers)
    json_body.py        request bodies that are not usable JSON (surrogates, deep nesting, ...) are 400s
    security.py         API keys, body-size limits, which routes only the admin listener serves
    admin_listener.py   the second listener, on 127.0.0.1:--admin-port: admin routes and probes
    disconnect.py       cancel a non-streaming answer's work when its client leaves
    coalesced_http.py   uvicorn's httptools protocol with one send per loop turn

Torch-free, like the router.
"""
