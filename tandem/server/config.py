"""ServerConfig: everything `tandem serve` was asked for, resolved once at start-up.

The worker contract (tandem/worker_contract.py) owns the command line the operator
writes; this module only adds the server's own flags and turns engine flags (SGLang's
names, e.g. --page-size 16) and the engine YAML into one EngineConfig.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tandem.engine.engine_config import EngineConfig
from tandem.worker_contract import (
    ADMIN_PORT,
    BOOTSTRAP_PORT,
    ENV_ADMIN_KEY,
    ENV_POD_IP,
    PREFILL,
    KvTransfer,
    add_worker_arguments,
    admin_port,
    bootstrap_port,
    kv_from_env,
)

ENV_API_KEY = "TANDEM_API_KEY"


@dataclass(frozen=True)
class ServerConfig:
    role: str
    model_path: str
    served_model_name: str
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    bootstrap_port: int = BOOTSTRAP_PORT
    api_key: str | None = None
    admin_key: str | None = None  # the admin routes on the main listener (never the API key)
    admin_port: int = ADMIN_PORT  # the admin listener on 127.0.0.1; 0: none
    max_queued_requests: int = 1024  # beyond the running slots; then 429
    max_request_bytes: int = 8 * 2**20
    drain_timeout: float = 30.0
    pod_ip: str | None = None
    kv_transfer: KvTransfer | None = None
    tool_call_parser: str | None = None  # None: the chat template says (tools/registry.py)
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.admin_key and self.admin_key == self.api_key:
            raise ValueError("--admin-key must differ from --api-key: the API key must not reach the admin routes")
        if self.admin_port and self.admin_port == self.port:
            raise ValueError(f"--admin-port {self.admin_port} is the HTTP port")

    @property
    def max_active(self) -> int:
        return self.engine.max_running_requests * self.engine.dp_size + self.max_queued_requests

    @property
    def standalone(self) -> bool:
        """Serves a request on its own: colocated, or decode (which prefills what no prefill
        worker sends it). A prefill worker needs a decode peer for every request."""
        return self.role != PREFILL


def _engine_flag_type(f: dataclasses.Field) -> type | None:
    t = str(f.type)
    if "bool" in t:
        return None  # a switch
    return int if "int" in t else float if "float" in t else str


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Every EngineConfig option as --<name-with-dashes>; given flags override the YAML."""
    g = p.add_argument_group("engine options (SGLang's names)")
    for f in dataclasses.fields(EngineConfig):
        if f.name in ("model", "pd_bootstrap_host", "pd_bootstrap_port"):  # from --host/--bootstrap-port
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _engine_flag_type(f)
        if kind is None and "None" in str(f.type):  # bool | None: unset is "decide at start-up"
            g.add_argument(flag, dest=f"engine_{f.name}", action=argparse.BooleanOptionalAction,
                           default=argparse.SUPPRESS)
        elif kind is None:
            g.add_argument(flag, dest=f"engine_{f.name}", action="store_true", default=argparse.SUPPRESS)
        else:
            g.add_argument(flag, dest=f"engine_{f.name}", type=kind, default=argparse.SUPPRESS,
                           metavar=f.name.upper())


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    add_worker_arguments(p)
    p.add_argument("--api-key", default=None, help=f"require this bearer key (or set ${ENV_API_KEY})")
    p.add_argument("--admin-key", default=None,
                   help=f"the key for the admin routes on the main port (or set ${ENV_ADMIN_KEY}); without it they "
                        "are served on the admin listener (127.0.0.1:--admin-port) only")
    p.add_argument("--max-queued-requests", type=int, default=1024)
    p.add_argument("--max-request-bytes", type=int, default=8 * 2**20)
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on /drain or SIGTERM")
    add_engine_arguments(p)
    p.set_defaults(engine_log_level="info")  # a server shows its load progress and time to ready


def resolve_model(model: str) -> str:
    from tandem.engine.modelgen.gguf_import import GGUFError
    from tandem.engine.modelgen.named_models import ModelFetchError
    from tandem.engine.modelgen.resolve import resolve_model as build_or_find

    try:
        return str(build_or_find(model))
    except (GGUFError, ModelFetchError) as exc:  # a file or download that is not a model: one line, no traceback
        raise SystemExit(f"tandem serve: --model {model}: {exc}") from None


def config_from_args(ns: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> ServerConfig:
    overrides = {k.removeprefix("engine_"): v for k, v in vars(ns).items() if k.startswith("engine_")}
    if ns.config:
        if not Path(ns.config).is_file():
            raise SystemExit(f"--config {ns.config}: no such file")
        engine, doc = EngineConfig.from_engine_yaml(Path(ns.config).read_text(), model=ns.model, **overrides)
        kv = doc.kv_transfer
    else:
        engine, kv = EngineConfig.from_kwargs(model=ns.model, **overrides), None
    return ServerConfig(
        role=ns.role, model_path=resolve_model(ns.model), served_model_name=ns.served_model_name or ns.model,
        engine=dataclasses.replace(engine, pd_bootstrap_host=ns.host, pd_bootstrap_port=bootstrap_port(ns)),
        host=ns.host, port=ns.port, bootstrap_port=bootstrap_port(ns),
        api_key=ns.api_key or environ.get(ENV_API_KEY) or None,
        admin_key=ns.admin_key or environ.get(ENV_ADMIN_KEY) or None,
        admin_port=admin_port(ns), max_queued_requests=ns.max_queued_requests,
        max_request_bytes=ns.max_request_bytes, drain_timeout=ns.drain_timeout, pod_ip=environ.get(ENV_POD_IP),
        kv_transfer=kv_from_env(environ) or kv, tool_call_parser=ns.tool_call_parser,
        reasoning_parser=ns.reasoning_parser,
    )
