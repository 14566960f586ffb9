"""Prometheus metric names shared by the workers (which export them) and the operator (which reads them).

Torch-free on purpose: the operator image imports this module and must stay small.
Histograms follow the Prometheus convention, so the exported series are
`<name>_bucket{le=...}`, `<name>_sum` and `<name>_count`.
"""

from __future__ import annotations

# Gauges, one value per worker process.
NUM_QUEUE_REQS = "tandem_num_queue_reqs"  # requests admitted but not yet scheduled
NUM_RUNNING_REQS = "tandem_num_running_reqs"  # requests in the running batch
KV_CACHE_USAGE = "tandem_kv_cache_usage"  # fraction 0..1 of KV pages in use
KV_HANDSHAKE_OK = "tandem_kv_handshake_ok"  # decode only: 1 once a KV handshake with a prefill pod succeeded

# Histograms, in seconds. Prefill workers export TTFT (arrival to first token);
# decode workers export ITL (gap between consecutive output tokens of one request).
TIME_TO_FIRST_TOKEN_SECONDS = "tandem_time_to_first_token_seconds"
INTER_TOKEN_LATENCY_SECONDS = "tandem_inter_token_latency_seconds"

# Counters.
KV_TRANSFER_FAILURES_TOTAL = "tandem_kv_transfer_failures_total"
# PD counts by `event` label (handshake_failures, local_prefills, kv_bytes_sent, ...): a gauge
# set from the schedulers' running totals.
PD_EVENTS = "tandem_pd_events"
# Prompt tokens of finished requests found in the prefix cache, either tier (a counter), and the
# host tier's running totals by `stat` label (written_tokens, loaded_tokens, dropped_tokens,
# written_bytes, loaded_bytes, load_seconds, capacity_tokens, used_tokens): a gauge, as PD_EVENTS.
# Host hits are loaded_tokens; device hits the rest of the cached tokens.
CACHED_PROMPT_TOKENS = "tandem_cached_prompt_tokens"
HOST_TIER = "tandem_host_tier"
DISK_TIER = "tandem_disk_tier"  # by `stat`: written/loaded/rejected/evicted pages, used_bytes, budget_bytes

# The model-server protocol of the Gateway API Inference Extension (GIE 003): the names its
# Endpoint Picker scrapes by default (its --total-queued-requests-metric, ...-running-...,
# --kv-cache-usage-percentage-metric, --lora-info-metric, --cache-info-metric flags' defaults,
# vLLM's names), so an EPP picks Tandem pods with no flags. Exported beside Tandem's own.
MSP_NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"  # gauge: requests queued
MSP_NUM_REQUESTS_RUNNING = "vllm:num_requests_running"  # gauge: requests being served
MSP_KV_CACHE_USAGE_PERC = "vllm:kv_cache_usage_perc"  # gauge: fraction 0..1 of KV blocks in use
# Gauge, value the start time; labels running_lora_adapters, waiting_lora_adapters, max_lora. Tandem
# serves no adapters: both lists empty, which the EPP reads as "no LoRA" (a missing family is an error).
MSP_LORA_REQUESTS_INFO = "vllm:lora_requests_info"
MSP_CACHE_CONFIG_INFO = "vllm:cache_config_info"  # gauge 1; labels block_size, num_gpu_blocks (prefix scorers)

# Bucket bounds the workers should use for the latency histograms, so that a p95
# read by the operator has useful resolution around typical SLO targets.
TTFT_BUCKETS_SECONDS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 60.0)
ITL_BUCKETS_SECONDS = (0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)

ALL_GAUGES = (NUM_QUEUE_REQS, NUM_RUNNING_REQS, KV_CACHE_USAGE, KV_HANDSHAKE_OK)
ALL_HISTOGRAMS = (TIME_TO_FIRST_TOKEN_SECONDS, INTER_TOKEN_LATENCY_SECONDS)

# ---- router -----------------------------------------------------------------------------------
# Exported by `tandem router`, read by the operator to scale a role up from zero replicas.
# Each carries a `role` label (ROUTER_ROLES); every role's series exists from the start, at 0.
# Gauge: requests held right now, waiting for an eligible worker of that role.
ROUTER_PENDING_REQUESTS = "tandem_router_pending_requests"
# Counters: requests that had to wait for that role, and those whose wait timed out (a 503).
ROUTER_CAPACITY_WAITS_TOTAL = "tandem_router_capacity_waits_total"
ROUTER_CAPACITY_TIMEOUTS_TOTAL = "tandem_router_capacity_timeouts_total"
ROUTER_ROLES = ("prefill", "decode", "colocated")
