"""Runtime: what every handler reaches through `request.app.state.runtime`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.sampling_params import DETERMINISTIC_SEED
from tandem.server.config import ServerConfig
from tandem.server.front import Front
from tandem.server.metrics import ServerMetrics
from tandem.server.tokens import Tokens
from tandem.server.tools.registry import DEFAULT_FORMAT
from tandem.web.errors import ApiError
from tandem.worker_contract import PREFILL


@dataclass
class Runtime:
    config: ServerConfig
    front: Front
    tokens: Tokens
    metrics: ServerMetrics
    tool_format: str = DEFAULT_FORMAT  # the model's tool-call format (tools/registry.py)
    started: int = field(default_factory=lambda: int(time.time()))
    ready: bool = False

    @property
    def default_seed(self) -> int | None:
        """The seed of a choice whose body names none: deterministic mode's, else None (a random one)."""
        return DETERMINISTIC_SEED if self.config.engine.deterministic else None

    def check_bootstrap(self, body: Any) -> None:
        """A prefill worker serves only disaggregated requests."""
        if self.config.role == PREFILL and body.bootstrap_room is None:
            raise ApiError(400, "a prefill worker serves only disaggregated requests: send it through a PD "
                                "router (bootstrap_room is missing)", param="bootstrap_room")
