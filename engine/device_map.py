"""Which device each rank runs on: DP rank r, TP rank t on GPU base_gpu_id + r * tp_size + t
(SGLang's convention: a replica's tensor-parallel ranks on neighbouring GPUs).

CUDA hands every process, and every thread in it, device 0 until told otherwise. Without
this mapping every rank loads its model onto one GPU and sizes its KV pool from that GPU's
free memory, so the second rank finds the first rank's pool already there.

    check_devices(config)      refuse at start-up a layout the visible GPUs cannot hold
    rank_device(config, r, t)  "cuda:<base_gpu_id + r * tp_size + t>", or the CPU device unchanged
    bind_device(device)        make it the calling thread's current CUDA device

torch is imported inside the functions: reading a config needs no torch.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.engine.engine_config import EngineConfig


# Without one of these no CUDA (or ROCm, or WSL) driver can answer: `auto` is then the CPU
# without importing torch, which a worker's front would otherwise do (seconds) before it
# starts its scheduler processes.
_GPU_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")


def gpu_nodes_present() -> bool:
    return any(os.path.exists(p) for p in _GPU_NODES)


def _on_cuda(device: str) -> bool:
    if device == "auto":
        if not gpu_nodes_present():
            return False
        import torch

        return torch.cuda.is_available()
    return device.split(":", 1)[0] == "cuda"


def _first_gpu(config: EngineConfig) -> int:
    """base_gpu_id, or the index of an explicit `cuda:N`, which names one GPU and so one rank."""
    _, _, index = config.device.partition(":")
    if not index:
        return config.base_gpu_id
    if config.dp_size > 1 or config.tp_size > 1 or config.base_gpu_id:
        raise ValueError(f"device={config.device} names one GPU; with dp_size, tp_size or base_gpu_id "
                         "use device=cuda (rank r runs on GPU base_gpu_id + r)")
    return int(index)


def check_devices(config: EngineConfig) -> None:
    """Raise ValueError when the ranks would run past the GPUs this process can see."""
    if not _on_cuda(config.device):
        return
    import torch

    first, visible = _first_gpu(config), torch.cuda.device_count()
    n = config.dp_size * config.tp_size
    if first + n > visible:
        raise ValueError(
            f"base_gpu_id {first} + dp_size {config.dp_size} x tp_size {config.tp_size} needs GPUs "
            f"{first}..{first + n - 1}, but {visible} are visible (CUDA_VISIBLE_DEVICES renumbers them from 0)")


def rank_device(config: EngineConfig, rank: int, tp_rank: int = 0) -> str:
    """The device string the engine uses for DP `rank`, TP `tp_rank`: `cuda:<id>` on CUDA, else
    the CPU device."""
    if not 0 <= rank < config.dp_size or not 0 <= tp_rank < config.tp_size:
        raise ValueError(f"rank {rank}/{tp_rank} is outside dp_size {config.dp_size} x tp_size {config.tp_size}")
    if not _on_cuda(config.device):
        return "cpu" if config.device == "auto" else config.device
    check_devices(config)
    return f"cuda:{_first_gpu(config) + rank * config.tp_size + tp_rank}"


def bind_device(device: Any) -> None:
    """Make `device` current for the calling thread. CUDA's current device is per thread, and
    events, streams and graph pools made without a device land on it: the scheduler thread and
    the forward thread each call this before their first CUDA work."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
