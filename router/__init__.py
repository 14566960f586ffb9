"""`tandem router`: the OpenAI-compatible front door (torch-free).

    app.py          FastAPI wiring and the router's state
    routes.py       OpenAI routes, /generate, health, metrics, the workers admin API
    proxy.py        dispatch, retries, PD pairs, the streaming relay
    policies.py     round_robin ... cache_aware;  prefix_index.py: what each worker has cached
    workers.py      workers, their load and circuit breakers;  health.py: active checks
    admission.py    token bucket + bounded FIFO queue;  tokenizer.py: HF fast tokenizer + template
    metrics.py      Prometheus series;  config.py, cli.py: `tandem router`
"""
