"""`tandem router`: the OpenAI-compatible front door (torch-free).

    app.py          FastAPI wiring and the router's state
    fast_path.py    the proxied routes as plain ASGI, in front of FastAPI
    routes.py       OpenAI routes, /generate, health, metrics, the workers admin API
    proxy.py        dispatch, retries, PD pairs, the streaming relay;  reported.py: token counts, errors
    upstream.py     the HTTP/1.1 client to the workers (httptools, pooled keep-alive)
    policies/       round_robin ... cache_aware, one class each;  prefix_index.py: what workers cache
    workers.py      workers, their load and circuit breakers;  health.py: active checks
    discovery.py    Kubernetes pods -> workers;  capacity.py: hold requests while a role is at zero
    admission.py    token bucket + bounded FIFO queue;  tokenizer.py: HF fast tokenizer + template
    metrics.py      Prometheus series;  config.py, cli.py: `tandem router`
"""
