"""The worker's /metrics under the model-server protocol of the Gateway API Inference Extension
(GIE proposal 003), read as its Endpoint Picker reads it with no flags: the families its flags
default to (vLLM's names), of the types it asks (gauges), with the semantics it assumes; the LoRA
info family present but naming no adapter (the EPP errors on a missing family and skips a series
whose adapter lists are both empty); the cache info's block size and block count, which its
prefix-aware scorers read. Tandem's own names stay beside them."""

from __future__ import annotations

import threading

from prometheus_client.parser import text_string_to_metric_families
from waits import wait_until
from worker_process import Worker

from tandem import metric_names as names

LONG = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(fams: dict, name: str) -> float:
    """What the EPP's getMetric takes: the family's (single, unlabelled) sample."""
    fam = fams[name]
    assert fam.type == "gauge", (name, fam.type)
    (sample,) = fam.samples
    return sample.value


def test_an_endpoint_picker_reads_load_kv_usage_and_the_cache_shape(model_path) -> None:
    with Worker.colocated(model_path("tiny"), "--max-total-tokens", "2048", "--page-size", "16",
                          "--max-running-requests", "1") as w:
        fams = _families(w.get("/metrics").text)
        assert _value(fams, names.MSP_NUM_REQUESTS_WAITING) == 0 == _value(fams, names.MSP_NUM_REQUESTS_RUNNING)
        (info,) = fams[names.MSP_CACHE_CONFIG_INFO].samples
        assert fams[names.MSP_CACHE_CONFIG_INFO].type == "gauge" and info.value == 1
        capacity = w.pool()["ranks"][0]["capacity_tokens"]
        assert info.labels == {"block_size": "16", "num_gpu_blocks": str(capacity // 16)}
        (lora,) = fams[names.MSP_LORA_REQUESTS_INFO].samples
        assert fams[names.MSP_LORA_REQUESTS_INFO].type == "gauge" and lora.value > 0  # a timestamp
        assert lora.labels == {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "0"}

        # One request runs (the running limit is 1), a second waits: the gauges say so while they do.
        done: list = []
        def send(text: str) -> None:
            done.append(w.post("/generate", {"text": text, "sampling_params": LONG}))

        threads = [threading.Thread(target=send, args=(t,)) for t in ("first request", "second request")]
        for t in threads:
            t.start()

        def loaded() -> dict | None:
            f = _families(w.get("/metrics").text)
            ok = (_value(f, names.MSP_NUM_REQUESTS_RUNNING) == 1 and _value(f, names.MSP_NUM_REQUESTS_WAITING) == 1)
            return f if ok else None

        busy = wait_until(loaded, 60, "one request running and one waiting")
        usage = _value(busy, names.MSP_KV_CACHE_USAGE_PERC)
        assert 0 < usage <= 1 and usage == _value(busy, names.KV_CACHE_USAGE)  # the same figure under both names
        assert _value(busy, names.NUM_QUEUE_REQS) == 1 and _value(busy, names.NUM_RUNNING_REQS) == 1
        for t in threads:
            t.join(120)
        assert len(done) == 2 and all(r.status_code == 200 for r in done)
        assert w.pool()["whole"]
