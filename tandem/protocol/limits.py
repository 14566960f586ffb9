"""The most one request may ask for: every number, list and string a client sends has a bound
here, checked where it enters (the HTTP bodies in openai_api.py, SamplingParams in the engine).

Without them one hostile body took a worker down: a `top_k` of 2**63 overflowed the int64
tensor the sampler builds, and the exception ended the scheduler loop. Sizes are also bounded
before any work: a million stop strings or chat messages would cost the front seconds of CPU
before a single check against the model's limits.
"""

from __future__ import annotations

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

MAX_TOP_K = 2**20  # above any vocabulary; the engine treats top_k >= vocab as the whole vocabulary
MAX_NEW_TOKENS = INT32_MAX  # the context length refuses far less; this only keeps the number an int32
MAX_SEED = INT64_MAX  # the sampler holds seeds in an int64 tensor
MAX_TOKEN_ID = INT32_MAX  # ids beyond the vocabulary are refused later, with the vocabulary's size
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
MAX_N = 64  # choices per request
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # per stop string: each one is searched for in the text at every token
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries (logit_bias is refused, but only after the body is parsed)
MAX_MESSAGES = 4096  # chat messages per request
MAX_PROMPTS = 4096  # prompts in one batched request
# Sequences one request opens (prompts x n). The router and each worker also hold a request to
# a quarter of their admission slots (router/admission.py, server/front.py).
MAX_CHOICES = MAX_PROMPTS
# Prompt text per request, before tokenizing: ~1M tokens, more than any model's context, and
# half the default --max-request-bytes, so it binds only when that limit is raised.
MAX_PROMPT_CHARS = 4 * 2**20
MAX_ID_CHARS = 256  # request ids (`rid`), user names
# A constraint (json_schema, regex, ebnf, structural_tag) is compiled on a worker thread: its
# text and its compile time are bounded, so one hostile schema costs one request, not the worker.
MAX_CONSTRAINT_CHARS = 256 * 1024
MAX_TOOLS = 128  # tool definitions per request
MAX_TOOL_CALLS = 128  # calls in one assistant message of a conversation
# One request's JSON Schemas (every tool's parameters, response_format, json_schema), counted
# together before any is checked against its metaschema (protocol/schema_budget.py). Within
# them the check is bounded: ~25 us of CPU per JSON value, on a worker thread, so a request at
# the bounds costs at most ~0.1 s of one core, once (a schema text that passed is remembered);
# 128 realistic tools cost ~55 ms. The forced tool choice is built from all tools' schemas, so
# their text fits one constraint's.
MAX_SCHEMA_CHARS = MAX_CONSTRAINT_CHARS
MAX_SCHEMA_NODES = 4096  # JSON values: 128 tools of ~30 (a few typed, described parameters each)
MAX_SCHEMA_DEPTH = 32  # nesting inside one schema; generated schemas rarely pass 10
MAX_SCHEMA_ITEMS = 1024  # entries of one list or object (enum, anyOf, properties, ...)
# Pairs of items compared for uniqueItems where jsonschema cannot sort (mixed types, objects):
# a draft-04 enum of ~180 mixed values, ~20 ms.
MAX_SCHEMA_COMPARISONS = 32768
MAX_SCHEMA_PATTERN_CHARS = 16384  # regexes (pattern, patternProperties) the check compiles
SCHEMA_CACHE_ENTRIES = 4096  # digests of schema texts a worker has already passed

# One request's sequences (prompts x n) may hold at most this share of a front's admission
# slots (the router's admission.py, a worker's server/front.py): one batch cannot starve the rest.
MAX_REQUEST_SHARE = 0.25


def max_sequences_per_request(slots: int) -> int:
    return max(1, int(slots * MAX_REQUEST_SHARE))
