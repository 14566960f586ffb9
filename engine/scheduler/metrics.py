"""Per-step scheduler metrics: TTFT, TPOT, queue depth, running requests, KV
utilisation, cache hits, and the device idle gap between consecutive forwards.

Plain numbers of constant size (a server runs for weeks): latencies keep a count
and a sum here, and the HTTP front observes the per-request latencies into its
prometheus-client histograms (tandem/metric_names.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Mean:
    count: int = 0
    total: float = 0.0

    def add(self, x: float) -> None:
        self.count += 1
        self.total += x

    @property
    def value(self) -> float:
        return self.total / self.count if self.count else 0.0


@dataclass
class SchedulerMetrics:
    ttft: Mean = field(default_factory=Mean)
    tpot: Mean = field(default_factory=Mean)
    num_prefill_batches: int = 0
    num_decode_batches: int = 0
    input_tokens: int = 0
    cache_hit_tokens: int = 0
    generated_tokens: int = 0
    forward_time: float = 0.0
    idle_gap_time: float = 0.0  # forward thread idle between consecutive forwards
    decode_forward_time: float = 0.0
    decode_idle_gap_time: float = 0.0
    last_batch_size: int = 0
    # CPU time the scheduler thread spends building decode batches and processing
    # their results, and the request-steps it covered: overhead per request per step.
    decode_overhead_time: float = 0.0
    decode_overhead_req_steps: int = 0
    # Load at the last step, and its peaks (the servers export these as gauges).
    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0
    peak_running: int = 0
    peak_kv_usage: float = 0.0
    finished: dict[str, int] = field(default_factory=dict)  # requests ended, by reason kind
    _last_forward_end: float | None = None
    _last_was_decode: bool = False

    def on_prefill_round(self, adder: Any) -> None:
        self.input_tokens += adder.log_input_tokens + adder.log_hit_tokens
        self.cache_hit_tokens += adder.log_hit_tokens

    def on_launch(self, batch: Any) -> None:
        self.last_batch_size = batch.batch_size
        if batch.mode.is_extend():
            self.num_prefill_batches += 1
        else:
            self.num_decode_batches += 1

    def on_result(self, batch: Any, result: Any) -> None:
        dt = result.forward_end - result.forward_start
        self.forward_time += dt
        decode = not batch.mode.is_extend()
        if self._last_forward_end is not None:
            gap = max(result.forward_start - self._last_forward_end, 0.0)
            self.idle_gap_time += gap
            if decode and self._last_was_decode:
                self.decode_idle_gap_time += gap
        if decode:
            self.decode_forward_time += dt
        self._last_forward_end, self._last_was_decode = result.forward_end, decode

    def on_finish(self, req: Any) -> None:
        """Once per request, whatever ended it (lifecycle.retire)."""
        kind = req.finished_reason.kind
        self.finished[kind] = self.finished.get(kind, 0) + 1
        self.generated_tokens += len(req.output_ids)
        if req.first_token_time is not None:
            self.ttft.add(req.first_token_time - req.arrival_time)
            if len(req.output_ids) > 1 and req.last_token_time is not None:
                self.tpot.add((req.last_token_time - req.first_token_time) / (len(req.output_ids) - 1))

    def on_step(self, num_waiting: int, num_running: int, kv_usage: float) -> None:
        self.num_waiting, self.num_running, self.kv_usage = num_waiting, num_running, kv_usage
        self.peak_running = max(self.peak_running, num_running)
        self.peak_kv_usage = max(self.peak_kv_usage, kv_usage)

    def on_overhead(self, batch: Any, seconds: float) -> None:
        if batch is not None and not batch.mode.is_extend():
            self.decode_overhead_time += seconds
            self.decode_overhead_req_steps += batch.batch_size

    @property
    def overhead_per_req_step_us(self) -> float:
        n = self.decode_overhead_req_steps
        return self.decode_overhead_time / n * 1e6 if n else 0.0

    def mark_idle(self) -> None:
        self._last_forward_end = None  # a gap caused by no work is not scheduler overhead

    @property
    def decode_idle_fraction(self) -> float:
        total = self.decode_forward_time + self.decode_idle_gap_time
        return self.decode_idle_gap_time / total if total else 0.0

    @property
    def cache_hit_rate(self) -> float:
        return self.cache_hit_tokens / self.input_tokens if self.input_tokens else 0.0

    def snapshot(self) -> dict[str, float]:
        return {
            "ttft_mean": self.ttft.value,
            "tpot_mean": self.tpot.value,
            "prefill_batches": self.num_prefill_batches,
            "decode_batches": self.num_decode_batches,
            "cache_hit_rate": self.cache_hit_rate,
            "decode_idle_fraction": self.decode_idle_fraction,
            "overhead_per_req_step_us": self.overhead_per_req_step_us,
            "generated_tokens": self.generated_tokens,
            "finished": dict(self.finished),
            "num_waiting": self.num_waiting,
            "num_running": self.num_running,
            "kv_usage": self.kv_usage,
            "peak_running": self.peak_running,
            "peak_kv_usage": self.peak_kv_usage,
            "time": time.time(),
        }
