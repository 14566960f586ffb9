"""`tandem serve`: the worker server every pod runs.

    app.py              FastAPI wiring: routes, error handlers, middleware, lifespan
    runtime.py          what every handler reaches through request.app.state.runtime
    front.py            the front's request table: admission, rid -> stream, abort, drain
    tokens.py           prompts, chat templates, logprob token text, the model's limits (400s)
    choices.py          one choice of a completion: a request's stream turned into text deltas
    openai_routes.py    OpenAI /v1/completions and /v1/chat/completions (one choice runner for both)
    generate_routes.py  SGLang's native /generate
    admin_routes.py     health, readiness, server and model info, metrics, drain, flush, abort
    disconnect.py       cancel a non-streaming answer's work when its client leaves
    errors.py           OpenAI error JSON for every failure
    security.py         API key and body-size limits; admin routes for the admin listener or the admin key
    admin_listener.py   the second listener, on 127.0.0.1:--admin-port: admin routes and probes
    json_body.py        request bodies that are not usable JSON (surrogates, deep nesting, ...) are 400s
    metrics.py          prometheus-client series (names in tandem/metric_names.py)
    config.py           ServerConfig, from the worker contract's command line
    coalesced_http.py   uvicorn's httptools protocol with one send per loop turn (router too)
    process.py          the server process: uvicorn, SIGTERM -> drain -> exit
    cli.py              the `tandem serve` command line
"""
