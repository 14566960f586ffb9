"""The worker contract: how every Tandem worker is started, in one place.

The operator renders pods from it, `tandem serve` parses its command line and engine
YAML with it, and `tandem up` and the tests start workers through it, so the three can
never disagree on a flag, a port, a path or an env name. torch-free and kopf-free: the
operator's and the router's images import it.

    argv   tandem serve --role R --model DIR --served-model-name NAME --host H --port P
                        [--bootstrap-port B] [--admin-port A] [--config engine.yaml]
                        [--tool-call-parser F] [--reasoning-parser R] [engine flags]
           tandem router --host H --port P [--admin-port A] [--model DIR] [--model-name NAME]
                         (--prefill-selector S --decode-selector S --namespace NS | --selector S ...
                          | --prefill URL=BOOTSTRAP... --decode URL... | --workers URL...)
    env    POD_NAME, POD_NAMESPACE, POD_IP (downward API); TANDEM_ROLE, TANDEM_KV_BACKEND,
           TANDEM_KV_PORT_BASE, TANDEM_KV_PORT_COUNT; UCX_TLS, UCX_NET_DEVICES when set;
           TANDEM_PD_SECRET (prefill and decode: from a Secret, pd_secret_env);
           TANDEM_TERMINATION_MESSAGE_PATH (operator pods: where a fatal start-up error goes)
    yaml   the engine's options under their SGLang names, plus the contract's own keys
           tp_size and kv_transfer {backend, port_base, port_count}
    tp     tp_size ranks per worker, one process and one GPU each; tp_head_problem is the rule
           the engine applies to the model's heads and the operator to spec.model.heads
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

# ---- ports and their names (the Service and NetworkPolicy refer to them by name) ----
HTTP_PORT = 8000
HTTP_PORT_NAME, BOOTSTRAP_PORT_NAME = "http", "bootstrap"
# A process's other ports default to fixed offsets from its serving port (--port), so that
# processes started by hand on one host with their own --port never collide on a default:
# a worker's admin listener is --port + 1 and a prefill worker's bootstrap --port + 998, the
# router's admin listener --port + 2. The admin listener (drain, flush, abort, the router's
# worker API) binds 127.0.0.1 only, so no containerPort and no Service port; the preStop hook calls it.
ADMIN_PORT_OFFSET, ROUTER_ADMIN_PORT_OFFSET, BOOTSTRAP_PORT_OFFSET = 1, 2, 998


def _offset_port(port: int, offset: int, fallback: int | None = None) -> int:
    """`port` + `offset`; `fallback` (else the offset from HTTP_PORT) where that is no port:
    --port 0 (any free port) or too close to 65535."""
    if 0 < port and port + offset <= 65535:
        return port + offset
    return HTTP_PORT + offset if fallback is None else fallback


def worker_admin_port(port: int) -> int:
    return _offset_port(port, ADMIN_PORT_OFFSET)


def router_admin_port(port: int) -> int:
    return _offset_port(port, ROUTER_ADMIN_PORT_OFFSET)


def bootstrap_port_for(port: int) -> int:
    return _offset_port(port, BOOTSTRAP_PORT_OFFSET)


# A worker's and a router's on HTTP_PORT, as in every pod: 8001, 8002 and 8998.
ADMIN_PORT, ROUTER_ADMIN_PORT = worker_admin_port(HTTP_PORT), router_admin_port(HTTP_PORT)
BOOTSTRAP_PORT = bootstrap_port_for(HTTP_PORT)
KV_PORT_NAME = "kv"  # the first of TANDEM_KV_PORT_COUNT ports from TANDEM_KV_PORT_BASE
# The router's Endpoint Picker (Envoy ext-proc over gRPC, `tandem router --epp-port`): GIE's own
# EPP listens on 9002, so an InferencePool written by hand for GIE's EPP needs no change of port.
EPP_PORT, EPP_PORT_NAME = 9002, "grpc-epp"

# ---- labels ----
# A hash of what makes prefill and decode compatible (image, model, engine config): the router
# pairs only pods of one generation, so a rolling update never pairs incompatible workers.
GENERATION_LABEL = "tandem.dev/model-generation"

# ---- paths ----
HEALTH_PATH = "/health"
READY_PATH = "/health/ready"
METRICS_PATH = "/metrics"
DRAIN_PATH = "/drain"
ENGINE_CONFIG_DIR = "/etc/tandem"
ENGINE_CONFIG_FILE = "engine.yaml"
ENGINE_CONFIG_PATH = f"{ENGINE_CONFIG_DIR}/{ENGINE_CONFIG_FILE}"
MODEL_MOUNT = "/models"
# Kubernetes reads a container's termination message from this file (its default path) and shows
# it in the pod's status, where the operator picks it up; at most 4 KiB of it are kept.
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
TERMINATION_MESSAGE_MAX_BYTES = 4096

# ---- roles ----
COLOCATED, PREFILL, DECODE = "colocated", "prefill", "decode"
WORKER_ROLES = (COLOCATED, PREFILL, DECODE)

# ---- how a chat answer is read (the server's registries: tandem/server/tools/, reasoning.py) ----
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")  # unset: read off the chat template
REASONING_PARSERS = ("deepseek-r1", "qwen3")  # unset: no reasoning_content

# ---- env names ----
ENV_POD_NAME, ENV_POD_NAMESPACE, ENV_POD_IP = "POD_NAME", "POD_NAMESPACE", "POD_IP"
ENV_ROLE = "TANDEM_ROLE"
ENV_KV_BACKEND = "TANDEM_KV_BACKEND"
ENV_KV_PORT_BASE = "TANDEM_KV_PORT_BASE"
ENV_KV_PORT_COUNT = "TANDEM_KV_PORT_COUNT"
ENV_UCX_TLS, ENV_UCX_NET_DEVICES = "UCX_TLS", "UCX_NET_DEVICES"
# The PD control channel's shared CURVE key (tandem/pd/secret.py): the same on every
# prefill and decode pod of an InferenceService, from a Secret's PD_SECRET_KEY. Env only: a flag
# would show in `ps`.
ENV_PD_SECRET, PD_SECRET_KEY = "TANDEM_PD_SECRET", "pd-secret"
# From a Secret (secretKeyRef), never on argv: the API key workers and router require, and the key
# the router sends to the workers (the operator renders both from spec.apiKeySecretRef).
ENV_API_KEY, ENV_WORKER_API_KEY = "TANDEM_API_KEY", "TANDEM_WORKER_API_KEY"
ENV_ADMIN_KEY = "TANDEM_ADMIN_KEY"  # the admin routes on the main port (workers and router; never the API key)
# Set only in operator pods: `tandem serve` started by hand or by `tandem up` writes no file.
ENV_TERMINATION_MESSAGE_PATH = "TANDEM_TERMINATION_MESSAGE_PATH"
DOWNWARD_ENV = {ENV_POD_NAME: "metadata.name", ENV_POD_NAMESPACE: "metadata.namespace", ENV_POD_IP: "status.podIP"}

KV_BACKENDS = ("nixl", "none")
DEFAULT_KV_PORT_BASE, DEFAULT_KV_PORT_COUNT = 17000, 16
_CONTRACT_KEYS = ("tp_size", "kv_transfer")


@dataclass(frozen=True)
class KvTransfer:
    backend: str = "nixl"
    port_base: int = DEFAULT_KV_PORT_BASE
    port_count: int = DEFAULT_KV_PORT_COUNT

    def __post_init__(self) -> None:
        if self.backend not in KV_BACKENDS:
            raise ValueError(f"kv_transfer.backend must be one of {KV_BACKENDS}, got {self.backend!r}")
        if not (1024 <= self.port_base and self.port_count >= 1 and self.port_base + self.port_count <= 65536):
            raise ValueError(f"kv_transfer ports {self.port_base}+{self.port_count} are outside 1024..65535")


@dataclass(frozen=True)
class EngineYaml:
    """The text at ENGINE_CONFIG_PATH: engine options plus the contract's keys."""

    engine_args: Mapping[str, Any] = field(default_factory=dict)
    tp_size: int = 1
    kv_transfer: KvTransfer = KvTransfer()

    def __post_init__(self) -> None:
        clash = set(_CONTRACT_KEYS) & set(self.engine_args)
        if clash:
            raise ValueError(f"{sorted(clash)} are contract keys, not engine options")
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp_size must be a positive integer, got {self.tp_size!r}")

    def render(self) -> str:
        doc = {**self.engine_args, "tp_size": self.tp_size, "kv_transfer": {
            "backend": self.kv_transfer.backend,
            "port_base": self.kv_transfer.port_base,
            "port_count": self.kv_transfer.port_count,
        }}
        return yaml.safe_dump(doc, sort_keys=True)

    @classmethod
    def parse(cls, text: str) -> EngineYaml:
        """The inverse of render(); a clear ValueError for a malformed file."""
        doc = yaml.safe_load(text) or {}
        if not isinstance(doc, dict):
            raise ValueError("the engine YAML must be a mapping of option names to values")
        kv = doc.pop("kv_transfer", None) or {}
        if not isinstance(kv, dict) or set(kv) - {"backend", "port_base", "port_count"}:
            raise ValueError(f"kv_transfer must map backend/port_base/port_count, got {kv!r}")
        return cls(engine_args=doc, tp_size=doc.pop("tp_size", 1), kv_transfer=KvTransfer(**kv))


def tp_head_problem(tp_size: int, num_heads: int, num_kv_heads: int | None = None) -> str | None:
    """Why `tp_size` ranks cannot split a model with these heads, or None when they can.

    Each rank holds num_heads / tp_size query heads, so tp_size must divide num_heads. KV heads
    (num_kv_heads; None: as many as query heads) are split the same way when tp_size divides
    them, or replicated when they divide tp_size (each KV head on tp_size / num_kv_heads ranks,
    as grouped-query models with few KV heads need); any other pair is refused."""
    kv = num_heads if num_kv_heads is None else num_kv_heads
    if tp_size < 1 or num_heads < 1 or kv < 1:
        return f"tp_size {tp_size}, {num_heads} attention heads and {kv} KV heads must all be positive"
    if num_heads % tp_size:
        return f"tp_size {tp_size} does not divide the model's {num_heads} attention heads"
    if kv % tp_size and tp_size % kv:
        return (f"tp_size {tp_size} and the model's {kv} KV heads: neither divides the other, so the KV "
                f"heads can be neither split across the ranks nor replicated on them")
    return None


@dataclass(frozen=True)
class WorkerArgs:
    """One worker's command line."""

    role: str
    model: str
    served_model_name: str
    host: str = "0.0.0.0"
    port: int = HTTP_PORT
    bootstrap_port: int = BOOTSTRAP_PORT
    config: str | None = ENGINE_CONFIG_PATH
    extra: tuple[str, ...] = ()  # engine flags under SGLang's names, passed through
    admin_port: int | None = None  # None: the server's default, worker_admin_port(port)
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.role not in WORKER_ROLES:
            raise ValueError(f"role must be one of {WORKER_ROLES}, got {self.role!r}")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}")


def worker_argv(args: WorkerArgs, program: Sequence[str] = ("tandem",)) -> list[str]:
    argv = [*program, "serve", "--role", args.role, "--model", args.model,
            "--served-model-name", args.served_model_name, "--host", args.host, "--port", str(args.port),
            "--bootstrap-port", str(args.bootstrap_port)]
    if args.admin_port is not None:
        argv += ["--admin-port", str(args.admin_port)]
    if args.config is not None:
        argv += ["--config", args.config]
    if args.tool_call_parser is not None:
        argv += ["--tool-call-parser", args.tool_call_parser]
    if args.reasoning_parser is not None:
        argv += ["--reasoning-parser", args.reasoning_parser]
    return [*argv, *args.extra]


@dataclass(frozen=True)
class RouterArgs:
    """The router's command line: pods found by label selectors (in a cluster) or static
    worker URLs (`tandem up`, tests). Prefill entries are (url, bootstrap port)."""

    host: str = "0.0.0.0"
    port: int = HTTP_PORT
    tokenizer: str | None = None  # the model directory: tokenizer.json and its chat template
    model_name: str | None = None
    namespace: str | None = None
    selector: str | None = None
    prefill_selector: str | None = None
    decode_selector: str | None = None
    workers: tuple[str, ...] = ()
    prefill: tuple[tuple[str, int], ...] = ()
    decode: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    admin_port: int | None = None  # None: the router's default, router_admin_port(port)

    def __post_init__(self) -> None:
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("static PD routing needs both prefill and decode workers")


def router_argv(args: RouterArgs, program: Sequence[str] = ("tandem",)) -> list[str]:
    argv = [*program, "router", "--host", args.host, "--port", str(args.port)]
    if args.admin_port is not None:
        argv += ["--admin-port", str(args.admin_port)]
    for flag, value in (("--model", args.tokenizer), ("--model-name", args.model_name),
                        ("--selector", args.selector), ("--prefill-selector", args.prefill_selector),
                        ("--decode-selector", args.decode_selector), ("--namespace", args.namespace)):
        if value is not None:
            argv += [flag, value]
    if args.workers:
        argv += ["--workers", *args.workers]
    if args.prefill:
        argv += ["--prefill", *(f"{url}={port}" for url, port in args.prefill), "--decode", *args.decode]
    return [*argv, *args.extra]


def worker_ports(role: str, kv_port_base: int) -> list[tuple[str, int]]:
    """(name, port) of each port a worker of `role` listens on: bootstrap on prefill only."""
    ports = [(HTTP_PORT_NAME, HTTP_PORT)]
    if role == PREFILL:
        ports.append((BOOTSTRAP_PORT_NAME, BOOTSTRAP_PORT))
    return [*ports, (KV_PORT_NAME, kv_port_base)]


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    """The `tandem serve` flags of the contract (the server adds nothing that contradicts them)."""
    p.add_argument("--role", choices=WORKER_ROLES, default=COLOCATED)
    p.add_argument("--model", required=True, help="model directory or built-in preset")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=HTTP_PORT)
    p.add_argument("--bootstrap-port", type=int, default=None,
                   help=f"prefill: the KV bootstrap (control) port (default --port + {BOOTSTRAP_PORT_OFFSET})")
    p.add_argument("--admin-port", type=int, default=None,
                   help=f"the admin listener's port on 127.0.0.1 (default --port + {ADMIN_PORT_OFFSET}; 0: none)")
    p.add_argument("--config", default=None, help="engine YAML (the operator mounts it at " + ENGINE_CONFIG_PATH + ")")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="the model's tool-call format (default: read off its chat template, else hermes)")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="split <think>...</think> into message.reasoning_content")


def bootstrap_port(ns: argparse.Namespace) -> int:
    """--bootstrap-port as given, else derived from --port."""
    return bootstrap_port_for(ns.port) if ns.bootstrap_port is None else ns.bootstrap_port


def admin_port(ns: argparse.Namespace) -> int:
    """--admin-port as given, else derived from --port."""
    return worker_admin_port(ns.port) if ns.admin_port is None else ns.admin_port


def parse_worker_argv(argv: Sequence[str]) -> WorkerArgs:
    """The inverse of worker_argv (without the program and "serve")."""
    p = argparse.ArgumentParser(prog="tandem serve", add_help=False)
    add_worker_arguments(p)
    ns, extra = p.parse_known_args(list(argv))
    return WorkerArgs(role=ns.role, model=ns.model, served_model_name=ns.served_model_name or ns.model,
                      host=ns.host, port=ns.port, bootstrap_port=bootstrap_port(ns), config=ns.config,
                      extra=tuple(extra), admin_port=ns.admin_port, tool_call_parser=ns.tool_call_parser,
                      reasoning_parser=ns.reasoning_parser)


def pd_secret_env(secret_name: str) -> dict[str, Any]:
    """The env entry giving a prefill or decode container the PD secret from Secret `secret_name`."""
    return {"name": ENV_PD_SECRET, "valueFrom": {"secretKeyRef": {"name": secret_name, "key": PD_SECRET_KEY}}}


def termination_message_env() -> dict[str, Any]:
    """The env entry telling an operator-run worker to write a fatal start-up error where
    Kubernetes reads the container's termination message (tandem/server/start_failure.py)."""
    return {"name": ENV_TERMINATION_MESSAGE_PATH, "value": TERMINATION_MESSAGE_PATH}


def downward_env() -> list[dict[str, Any]]:
    """POD_NAME, POD_NAMESPACE and POD_IP from the downward API (workers and the router)."""
    return [{"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}} for name, path in DOWNWARD_ENV.items()]


def worker_env(role: str, kv: KvTransfer, transports: Sequence[str] = (),
               devices: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Container env entries (Kubernetes' name/value and name/valueFrom shapes)."""
    env = downward_env() + [
        {"name": ENV_ROLE, "value": role},
        {"name": ENV_KV_BACKEND, "value": kv.backend},
        {"name": ENV_KV_PORT_BASE, "value": str(kv.port_base)},
        {"name": ENV_KV_PORT_COUNT, "value": str(kv.port_count)},
    ]
    if transports:
        env.append({"name": ENV_UCX_TLS, "value": ",".join(transports)})
    if devices:
        env.append({"name": ENV_UCX_NET_DEVICES, "value": ",".join(devices)})
    return env


def kv_from_env(environ: Mapping[str, str]) -> KvTransfer | None:
    """The KV port range the operator opened, from a worker's env (None when unset)."""
    if ENV_KV_PORT_BASE not in environ:
        return None
    return KvTransfer(backend=environ.get(ENV_KV_BACKEND, "nixl"), port_base=int(environ[ENV_KV_PORT_BASE]),
                      port_count=int(environ.get(ENV_KV_PORT_COUNT, DEFAULT_KV_PORT_COUNT)))
