"""Everything that crosses a process boundary, torch-free.

- `messages`: front <-> scheduler (requests, admin commands, outputs), versioned on the wire.
- `openai_api`, `chat_api`: the HTTP request bodies shared by the worker and the router (OpenAI
  completions and chat, SGLang's `/generate`), each validated once, here; their parts
  `response_format`, `tools` (and the constraint a forced tool choice becomes), `schema_budget`
  (what a request's JSON Schemas may cost), `schema_check` (each checked as a schema, off the
  event loop, against `metaschemas`), `body` (the base model).

- `kv_layout`: a worker's KV buffer as a transfer agent sees it (exchanged in the PD handshake).

The prefill <-> decode messages live with the rest of PD, in `tandem.pd.protocol`.
"""
