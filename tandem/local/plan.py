"""The local stack's plan: which processes `tandem up` starts, with which command lines.

Every argv, env entry and engine YAML comes from the worker contract, as the operator
renders them for pods; only the addresses differ: 127.0.0.1 and free ports instead of
Services and fixed container ports, one KV port range per worker instead of one per
pod IP, and a PD secret made for the run instead of a Secret per InferenceService.
torch-free: planning needs no engine.
"""

from __future__ import annotations

import random
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from tandem import worker_contract as contract
from tandem.pd.secret import new_pd_secret

ROUTER = "router"
# The worker's own entry point, so that a venv without the console script on PATH still works.
PROGRAM = (sys.executable, "-m", "tandem.cli")


@dataclass(frozen=True)
class UpConfig:
    model: str  # a model directory (resolved: presets are built before the plan)
    served_model_name: str
    run_dir: Path  # engine YAMLs, logs when asked, stack.json
    host: str = "127.0.0.1"
    port: int = 8000
    prefill: int = 1
    decode: int = 1
    colocated: bool = False
    dp: int | None = None  # data-parallel replicas of the serving role: decode workers, or colocated ones
    worker_args: tuple[str, ...] = ()  # engine flags for every worker (SGLang's names), as extraArgs in a CR
    router_args: tuple[str, ...] = ()
    cpus: tuple[int, ...] = ()  # cores to share out among the workers; () runs them unpinned
    random_weights: bool = False  # a built-in preset: its answers are noise, and the first answer says so
    # Every worker in deterministic mode (engine_config.deterministic): the same question gets the
    # same answer whatever the cache holds, which a newcomer's first minutes test (README).
    deterministic: bool = False

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.dp or 1) < 1:
            raise ValueError("--prefill, --decode and --dp take counts of at least 1")

    @property
    def serving_replicas(self) -> int:
        return self.dp or self.decode


@dataclass(frozen=True)
class Component:
    name: str  # "prefill-0", "decode-1", "worker-0", "router"
    role: str  # a worker role, or "router"
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    port: int = 0
    files: Mapping[str, str] = field(default_factory=dict)  # path -> text, written before start
    cpus: tuple[int, ...] = ()  # pinned to these cores (its torch threads follow: engine/launch.cpu_budget)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ready_url(self) -> str:
        # Decode answers 200 on /health/ready only after a KV handshake with a prefill worker.
        return self.url + contract.READY_PATH


class Ports:
    """Free ports for one stack, never handing out the same one twice."""

    def __init__(self, taken: Sequence[int] = ()) -> None:
        self.taken = set(taken)
        self._rng = random.Random()

    def one(self) -> int:
        """A free port below the kernel's ephemeral range. Asking the kernel for port 0 hands out
        an ephemeral port, the pool every outgoing connection and every UCX listener also draws
        from: between choosing it and the worker binding it (seconds of start-up) one of those
        could take it (seen: a decode worker's HTTP port taken while it loaded)."""
        low, high = _static_range()
        for _ in range(1000):
            port = self._rng.randrange(low, high)
            if port not in self.taken and bindable("127.0.0.1", port):
                self.taken.add(port)
                return port
        raise RuntimeError(f"no free port in {low}-{high}")

    def block(self, count: int, start: int = contract.DEFAULT_KV_PORT_BASE) -> int:
        """The first of `count` consecutive free ports at or above `start` (UCX's KV listeners)."""
        base = start
        while base + count <= 65536:
            window = range(base, base + count)
            if not self.taken.intersection(window) and all(bindable("0.0.0.0", p) for p in window):
                self.taken.update(window)
                return base
            base += count
        raise RuntimeError(f"no {count} consecutive free ports above {start}")


_PROCESS_PORTS = Ports()


def free_port() -> int:
    """A free port below the ephemeral range, never the same one twice in this process."""
    return _PROCESS_PORTS.one()


def _static_range() -> tuple[int, int]:
    """[low, high) of ports the kernel never hands out on its own: 10000 up to its ephemeral
    range (net.ipv4.ip_local_port_range, 32768 by default)."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    return (10000, ephemeral) if ephemeral > 12000 else (ephemeral - 2000, ephemeral)


def bindable(host: str, port: int) -> bool:
    """Whether a listener could take host:port now (UCX's KV listeners use 0.0.0.0). SO_REUSEADDR
    as uvicorn sets it: connections left in TIME_WAIT do not make a port busy."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _env(name: str, role: str, kv: contract.KvTransfer) -> dict[str, str]:
    """The pod env the operator writes, with the downward API's fields filled in locally."""
    fields = {"metadata.name": name, "metadata.namespace": "local", "status.podIP": "127.0.0.1"}
    env = {}
    for entry in contract.worker_env(role, kv):
        env[entry["name"]] = entry["value"] if "value" in entry else fields[entry["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def _worker(cfg: UpConfig, ports: Ports, name: str, role: str, engine_args: Mapping[str, object],
            pd_secret: str | None = None) -> Component:
    port, bootstrap = ports.one(), ports.one() if role == contract.PREFILL else contract.BOOTSTRAP_PORT
    kv = contract.KvTransfer(backend="nixl" if role != contract.COLOCATED else "none",
                             port_base=ports.block(contract.DEFAULT_KV_PORT_COUNT),
                             port_count=contract.DEFAULT_KV_PORT_COUNT)
    config = cfg.run_dir / f"{name}.yaml"
    argv = contract.worker_argv(contract.WorkerArgs(
        role=role, model=cfg.model, served_model_name=cfg.served_model_name, host="127.0.0.1", port=port,
        bootstrap_port=bootstrap, config=str(config), extra=cfg.worker_args,
        admin_port=ports.one()), program=PROGRAM)  # one host: each its own admin listener
    engine_args = {**engine_args, **({"deterministic": True} if cfg.deterministic else {})}
    yaml_text = contract.EngineYaml(engine_args=dict(engine_args), kv_transfer=kv).render()
    env = {**_env(name, role, kv), **({contract.ENV_PD_SECRET: pd_secret} if pd_secret else {})}
    return Component(name, role, tuple(argv), env, port, {str(config): yaml_text})


def share_cores(cpus: Sequence[int], n: int) -> list[tuple[int, ...]]:
    """Disjoint slices of `cpus` for n workers, as pods get CPU limits: a 2-core machine gives
    prefill and decode one core each rather than two threads each on the same two cores.
    More workers than cores share single cores round-robin."""
    cpus = sorted(cpus)
    if n <= len(cpus):
        return [tuple(cpus[i * len(cpus) // n:(i + 1) * len(cpus) // n]) for i in range(n)]
    return [(cpus[i % len(cpus)],) for i in range(n)]


def bootstrap_port(worker: Component) -> int:
    return contract.parse_worker_argv(worker.argv[len(PROGRAM) + 1:]).bootstrap_port


def plan(cfg: UpConfig, ports: Ports | None = None) -> list[Component]:
    """Workers first, in start order, then the router on cfg.port."""
    ports = ports or Ports(taken=(cfg.port,))
    if cfg.colocated:
        workers = [_worker(cfg, ports, f"worker-{i}", contract.COLOCATED, {}) for i in range(cfg.serving_replicas)]
        router = contract.RouterArgs(workers=tuple(w.url for w in workers))
    else:
        secret = new_pd_secret()  # one per run: only this stack's workers take part in its PD traffic
        prefill = [_worker(cfg, ports, f"prefill-{i}", contract.PREFILL, {}, secret) for i in range(cfg.prefill)]
        peers = ",".join(f"127.0.0.1:{bootstrap_port(p)}" for p in prefill)
        decode = [_worker(cfg, ports, f"decode-{i}", contract.DECODE, {"pd_prefill_peers": peers}, secret)
                  for i in range(cfg.serving_replicas)]
        workers = [*prefill, *decode]
        router = contract.RouterArgs(prefill=tuple((p.url, bootstrap_port(p)) for p in prefill),
                                     decode=tuple(d.url for d in decode))
    if cfg.cpus:
        workers = [replace(w, cpus=c) for w, c in zip(workers, share_cores(cfg.cpus, len(workers)))]
    router = replace(router, host=cfg.host, port=cfg.port, tokenizer=cfg.model, model_name=cfg.served_model_name,
                     extra=cfg.router_args, admin_port=ports.one())
    return [*workers, Component(ROUTER, ROUTER, tuple(contract.router_argv(router, program=PROGRAM)), {}, cfg.port)]
