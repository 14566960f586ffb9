"""Data-parallel ranks on their own GPUs, tested on CPU with a faked device count: rank r runs
on cuda:<base_gpu_id + r>, each thread that issues CUDA work makes that device current first,
KV sizing asks that device, and a layout past the visible GPUs is refused before any rank starts."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from tandem.engine.device_map import check_devices, rank_device
from tandem.engine.engine_config import EngineConfig
from tandem.engine.kvcache.kv_memory import device_memory
from tandem.engine.runner.model_worker import OverlapWorker


@pytest.fixture
def four_gpus(monkeypatch) -> list[tuple[str, str]]:
    """torch.cuda with 4 visible devices; returns the (thread, device) of every set_device."""
    from tandem.engine import device_map

    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(device_map, "gpu_nodes_present", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: calls.append((threading.current_thread().name, str(torch.device(d)))))
    return calls


def _cfg(**kw: object) -> EngineConfig:
    return EngineConfig(chunked_prefill_size=2048, **kw)  # an explicit chunk: no device query


def test_rank_r_runs_on_gpu_base_plus_r(four_gpus) -> None:
    assert [rank_device(_cfg(device="cuda", dp_size=4), r) for r in range(4)] == [f"cuda:{i}" for i in range(4)]
    assert [rank_device(_cfg(dp_size=2, base_gpu_id=2), r) for r in range(2)] == ["cuda:2", "cuda:3"]  # auto
    assert rank_device(_cfg(device="cuda:3"), 0) == "cuda:3"
    assert rank_device(_cfg(device="cpu", dp_size=4, base_gpu_id=9), 3) == "cpu"
    with pytest.raises(ValueError, match="names one GPU"):
        rank_device(_cfg(device="cuda:1", dp_size=2), 0)
    with pytest.raises(ValueError, match="base_gpu_id must be >= 0"):
        _cfg(base_gpu_id=-1)


@pytest.mark.parametrize("base,dp", [(0, 5), (1, 4), (3, 2), (4, 1)])
def test_a_layout_past_the_visible_gpus_is_refused(four_gpus, base, dp) -> None:
    cfg = _cfg(device="cuda", dp_size=dp, base_gpu_id=base)
    with pytest.raises(ValueError, match=f"base_gpu_id {base} \\+ dp_size {dp}.*4 are visible"):
        check_devices(cfg)
    with pytest.raises(ValueError, match="4 are visible"):
        rank_device(cfg, 0)
    check_devices(_cfg(device="cpu", dp_size=dp, base_gpu_id=base))  # no GPU asked for: nothing to check


def test_the_dp_controller_refuses_before_spawning_a_rank(four_gpus, monkeypatch) -> None:
    from tandem.engine import dp_controller

    def set_up_ranks() -> None:  # the sockets come before the ranks: reaching them is too late
        raise AssertionError("the controller began setting up its ranks")

    monkeypatch.setattr(dp_controller.socket_dir, "make", set_up_ranks)
    with pytest.raises(ValueError, match="4 are visible"):
        dp_controller.DataParallelController(_cfg(device="cuda", dp_size=3, base_gpu_id=2), "unused", print)


def test_build_scheduler_binds_the_rank_gpu_before_the_model_and_pool(four_gpus, monkeypatch) -> None:
    from tandem.engine import launch
    from tandem.engine.runner import model_runner

    class Loaded(Exception):
        pass

    def runner(path, config, tp):
        four_gpus.append(("model", config.device))
        raise Loaded

    monkeypatch.setattr(model_runner, "ModelRunner", runner)
    with pytest.raises(Loaded):
        launch.build_scheduler(_cfg(device="cuda", dp_size=2, base_gpu_id=1), "unused", None, print, dp_rank=1)
    me = threading.current_thread().name
    assert four_gpus == [(me, "cuda:2"), ("model", "cuda:2")]


def test_tp_ranks_take_neighbouring_gpus(four_gpus) -> None:
    """DP rank r, TP rank t on GPU base + r * tp_size + t; dp x tp past the visible GPUs is refused."""
    cfg = _cfg(device="cuda", dp_size=2, tp_size=2)
    assert [rank_device(cfg, r, t) for r in range(2) for t in range(2)] == [f"cuda:{i}" for i in range(4)]
    assert rank_device(_cfg(device="cuda", tp_size=2, base_gpu_id=2), 0, 1) == "cuda:3"
    with pytest.raises(ValueError, match="dp_size 2 x tp_size 4 needs GPUs 0..7, but 4 are visible"):
        check_devices(_cfg(device="cuda", dp_size=2, tp_size=4))
    with pytest.raises(ValueError, match="outside"):
        rank_device(cfg, 0, 2)


def test_the_forward_thread_makes_the_rank_gpu_current(four_gpus, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "Stream", lambda: None)  # no stream context on CPU
    worker = SimpleNamespace(runner=SimpleNamespace(device=torch.device("cuda:3")))
    handoff = SimpleNamespace(mark=lambda: None, wait=lambda token: None)
    OverlapWorker(worker, SimpleNamespace(), handoff=handoff).shutdown()  # type: ignore[arg-type]
    assert four_gpus == [("tandem-forward", "cuda:3")]


def test_kv_sizing_asks_the_rank_gpu(four_gpus, monkeypatch) -> None:
    asked: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (asked.append(d), (1, 2))[1])
    device = torch.device(rank_device(_cfg(device="cuda", dp_size=2, base_gpu_id=2), 1))
    assert device_memory(device) == (2, 1)
    assert [torch.device(d).index for d in asked] == [3]
