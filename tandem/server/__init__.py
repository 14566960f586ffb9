"""`tandem serve`: the worker server every pod runs.

    app.py              FastAPI wiring: routes, error handlers, middleware, lifespan
    runtime.py          what every handler reaches through request.app.state.runtime
    front.py            the front's request table: admission, rid -> stream, abort, drain
    tokens.py           prompts, chat templates, logprob token text, the model's limits (400s)
    choices.py          one choice of a completion: a request's stream turned into text deltas
    openai_routes.py    OpenAI /v1/completions and /v1/models, and what chat shares with them
    chat_routes.py      OpenAI /v1/chat/completions (the same choice runner)
    assistant_output.py a chat choice's text as reasoning, content and tool calls
    reasoning.py        --reasoning-parser: <think>...</think> split off
    markers.py          finding markers in text that arrives in pieces
    tools/              tool-call formats, the streaming scanner, the sources per tool_choice
    generate_routes.py  SGLang's native /generate
    admin_routes.py     health, readiness, server and model info, metrics, drain, flush, abort
    metrics.py          prometheus-client series (names in tandem/metric_names.py)
    config.py           ServerConfig, from the worker contract's command line
    process.py          the server process: uvicorn, SIGTERM -> drain -> exit
    cli.py              the `tandem serve` command line

The HTTP pieces it shares with the router (errors, JSON bodies, keys, the admin listener)
are in `tandem.web`.
"""
