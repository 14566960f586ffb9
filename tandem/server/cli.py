"""`tandem serve`: one worker (the operator's pods, `tandem up`, the tests all start it
through tandem.worker_contract.worker_argv). Imports nothing heavy until it runs."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import NoReturn

from tandem.server import schedulers
from tandem.server.config import add_server_arguments, config_from_args
from tandem.server.start_failure import reported_start_failure


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over HTTP (OpenAI and SGLang APIs): one worker")
    add_server_arguments(p)
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> NoReturn:
    # Before the config: resolving --model may fetch, import or build it, and says so in the log.
    logging.basicConfig(level=str(args.engine_log_level).upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with reported_start_failure():  # an operator pod's status shows why it cannot start
        config = config_from_args(args)
        # The ranks load the model while this process imports its web stack (schedulers.py).
        ranks = schedulers.start(config)
    try:
        from tandem.server.process import run

        code = run(config, ranks.serve)
    finally:
        ranks.shutdown()  # done by the lifespan already, unless the app failed before it ran
    # Everything is stopped and joined by now; the interpreter's own teardown would still run
    # torch's ~130 operator-library finalizers (1.5-2 s), which every pod termination, restart
    # and rollout would wait on. Flush what is buffered and leave.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
