"""What the cluster admin (through the chart) lets InferenceService authors do: operator-wide,
fixed at start-up, never read from a CR.

Whoever may create an InferenceService must not get host-level pods through the operator's
service account, so host access is off unless the chart turns it on; and the workers' HTTP
port is reachable only from the router, the operator and the namespaces named here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OperatorPolicy:
    # hostPath model sources, and template overrides that reach the host or change identity
    # (hostNetwork/PID/IPC, privileged, root, serviceAccountName, command/args).
    allow_host_access: bool = False
    # Namespaces whose pods may reach the workers' HTTP port (metrics, OpenAI API): the
    # operator's own namespace (it scrapes metrics) and e.g. a monitoring namespace.
    http_from_namespaces: tuple[str, ...] = ()
