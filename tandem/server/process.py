"""The server process: uvicorn (uvloop, and httptools with coalesced writes, where installed)
around the app.

SIGTERM (and a first Ctrl-C) drains: readiness turns false, in-flight requests get
--drain-timeout seconds, the rest are aborted, the KV pool is checked, then uvicorn
stops and the lifespan shuts the schedulers down. A second signal exits at once.

Beside it, the admin listener on 127.0.0.1:--admin-port (admin_listener.py) serves /drain
(the preStop hook's call), /flush_cache and /abort_request without a key.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

import uvicorn

from tandem.server.app import SCHEDULER_DIED_EXIT, build_app
from tandem.server.config import ServerConfig
from tandem.server.schedulers import ClientFactory
from tandem.web import admin_listener
from tandem.web.coalesced_http import http_protocol

log = logging.getLogger("tandem.server")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: Any) -> None:
        super().__init__(config)
        self.app = app
        self.draining = False
        app.state.request_exit = self.request_exit

    def request_exit(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig: int, frame: Any) -> None:
        rt = getattr(self.app.state, "runtime", None)
        if self.draining or rt is None or not self.started:
            return super().handle_exit(sig, frame)
        self.draining = True
        log.info("%s: draining", signal.Signals(sig).name)
        loop = rt.front.loop
        loop.call_soon_threadsafe(lambda: loop.create_task(self._drain(rt)))

    async def _drain(self, rt: Any) -> None:
        try:
            await rt.front.drain(rt.config.drain_timeout)
        finally:
            self.should_exit = True


def run(config: ServerConfig, client_factory: ClientFactory | None = None) -> int:
    """Serve until stopped; `client_factory` gives the app its scheduler client (default: ranks
    spawned once the lifespan starts)."""
    app = build_app(config, client_factory)
    server = DrainingServer(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                           timeout_graceful_shutdown=5, access_log=False,
                                           http=http_protocol()), app)
    admin_listener.run(server, app, config.admin_port)
    if getattr(app.state, "scheduler_died", False):  # stopped because of it: a failure to replace, not a drain
        return SCHEDULER_DIED_EXIT
    return 0 if server.started else 1
