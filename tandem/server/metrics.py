"""The worker's prometheus-client series, under the names in tandem/metric_names.py.

Latency histograms are observed in the front as outputs arrive (TTFT from admission,
ITL between a request's tokens), so their memory is constant however long the server
runs. Load gauges are read from the schedulers at scrape time (one StatusReq round trip).
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tandem import metric_names as names
from tandem.protocol.messages import ReqOutput


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram(names.TIME_TO_FIRST_TOKEN_SECONDS, "admission to first token",
                              buckets=names.TTFT_BUCKETS_SECONDS, registry=r)
        self.itl = Histogram(names.INTER_TOKEN_LATENCY_SECONDS, "gap between a request's tokens",
                             buckets=names.ITL_BUCKETS_SECONDS, registry=r)
        self.queue = Gauge(names.NUM_QUEUE_REQS, "requests waiting to be scheduled", registry=r)
        self.running = Gauge(names.NUM_RUNNING_REQS, "requests in the running batch", registry=r)
        self.kv_usage = Gauge(names.KV_CACHE_USAGE, "fraction of KV pages in use", registry=r)
        self.requests = Counter("tandem_requests", "finished requests by finish reason", ["reason"], registry=r)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("tandem_generation_tokens", "generated tokens", registry=r)
        self.pool_whole = Gauge("tandem_kv_pool_whole", "1 when the last idle integrity check passed", registry=r)
        self.cached_tokens = Counter(names.CACHED_PROMPT_TOKENS, "prompt tokens of finished requests found in "
                                     "the prefix cache (device or host tier)", registry=r)
        self.host_tier = Gauge(names.HOST_TIER, "host KV tier totals since start (written/loaded/dropped tokens "
                               "and bytes, load_seconds) and size (capacity_tokens, used_tokens)", ["stat"], registry=r)
        self.disk_tier = Gauge(names.DISK_TIER, "disk KV tier totals since start (written, loaded, rejected and "
                               "evicted pages) and size (used_bytes, budget_bytes)", ["stat"], registry=r)
        # The same load under the names a Gateway API Inference Extension EPP scrapes by default.
        self.msp_waiting = Gauge(names.MSP_NUM_REQUESTS_WAITING, "requests queued (GIE model-server protocol)",
                                 registry=r)
        self.msp_running = Gauge(names.MSP_NUM_REQUESTS_RUNNING, "requests being served (GIE model-server protocol)",
                                 registry=r)
        self.msp_kv_usage = Gauge(names.MSP_KV_CACHE_USAGE_PERC, "fraction 0..1 of KV blocks in use (GIE "
                                  "model-server protocol)", registry=r)
        lora = Gauge(names.MSP_LORA_REQUESTS_INFO, "LoRA adapters running and waiting: none (GIE model-server "
                     "protocol)", ["running_lora_adapters", "waiting_lora_adapters", "max_lora"], registry=r)
        lora.labels("", "", "0").set(time.time())
        self.msp_cache = Gauge(names.MSP_CACHE_CONFIG_INFO, "KV block size and count (GIE model-server protocol)",
                               ["block_size", "num_gpu_blocks"], registry=r)
        # PD (prefill and decode roles): the scheduler's running counts, summed over ranks.
        self.handshake_ok = Gauge(names.KV_HANDSHAKE_OK, "decode: 1 while a prefill handshake holds", registry=r)
        self.pd_events = Gauge(names.PD_EVENTS, "PD counts since start (handshakes, handshake_failures, "
                               "transferred, local_prefills, reused_tokens, kv_bytes_sent, failed, ...)",
                               ["event"], registry=r)

    def observe(self, stream: Any, out: ReqOutput) -> None:
        """Called by the front for every output, before its handler sees it."""
        n = len(out.token_ids)
        if n:
            now = time.monotonic()
            if stream.first_token is None:
                stream.first_token = now
                self.ttft.observe(now - stream.submitted)
                n -= 1
            elif stream.last_token is not None:
                for _ in range(n):
                    self.itl.observe((now - stream.last_token) / n)
            stream.last_token = now
            self.generation_tokens.inc(len(out.token_ids))
        if out.finished:
            self.requests.labels((out.finish_reason or {}).get("kind", "stop")).inc()
            self.prompt_tokens.inc(out.prompt_tokens)
            self.cached_tokens.inc(out.cached_tokens)

    def render(self, pools: list[dict[str, Any]]) -> bytes:
        for ours, msp, value in (
            (self.queue, self.msp_waiting, sum(p["num_waiting"] for p in pools)),
            (self.running, self.msp_running, sum(p["num_running"] for p in pools)),
            (self.kv_usage, self.msp_kv_usage, max(p["kv_usage"] for p in pools)),
        ):
            ours.set(value)
            msp.set(value)
        block = pools[0]["page_size"]  # DP ranks: one pod to an EPP, their blocks summed
        self.msp_cache.labels(str(block), str(sum(p["capacity_tokens"] // block for p in pools))).set(1)
        pd = [p["pd"] for p in pools if p.get("pd")]
        if pd and pd[0]["role"] == "decode":
            self.handshake_ok.set(1.0 if all(x["ready"] for x in pd) else 0.0)
        for key in sorted({k for x in pd for k, v in x.items() if isinstance(v, int) and not isinstance(v, bool)}):
            self.pd_events.labels(key).set(sum(x.get(key, 0) for x in pd))
        for gauge, name in ((self.host_tier, "host_tier"), (self.disk_tier, "disk_tier")):
            tiers = [p[name] for p in pools if p.get(name)]
            for key in sorted({k for t in tiers for k in t}):
                gauge.labels(key).set(sum(t.get(key, 0) for t in tiers))
        if all(p["whole"] is not None for p in pools):
            self.pool_whole.set(1.0 if all(p["whole"] for p in pools) else 0.0)
        return generate_latest(self.registry)
