"""`tandem serve`: the worker server every pod runs.

    app.py          FastAPI wiring: routes, error handlers, middleware, lifespan
    front.py        the front's request table: admission, rid -> stream, abort, drain
    completions.py  OpenAI /v1/completions and /v1/chat/completions (one choice runner for both)
    generate.py     SGLang's native /generate
    admin.py        health, readiness, server and model info, metrics, drain, flush, abort
    errors.py       OpenAI error JSON for every failure
    security.py     API key and body-size limits
    metrics.py      prometheus-client series (names in tandem/metric_names.py)
    config.py       ServerConfig, from the worker contract's command line
    cli.py          the `tandem serve` command: uvicorn, SIGTERM -> drain -> exit
"""
