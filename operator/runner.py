"""Starting the operator: kopf's embedded run with our registry, config and standalone mode.

Standalone because the chart runs one replica and ships no kopf peering CRDs; a
second replica would need peering (or leader election) first.
"""

from __future__ import annotations

from collections.abc import Sequence

import kopf

from tandem.operator.handlers import OperatorConfig, register


def run_operator(namespaces: Sequence[str], all_namespaces: bool, config: OperatorConfig,
                 liveness: str | None = None, verbose: bool = False) -> int:
    registry = kopf.OperatorRegistry()
    register(registry, config)
    kopf.configure(verbose=verbose)
    kopf.run(
        registry=registry,
        standalone=True,
        clusterwide=all_namespaces,
        namespaces=list(namespaces),
        liveness_endpoint=liveness,
        memo=kopf.Memo(config=config),
    )
    return 0
