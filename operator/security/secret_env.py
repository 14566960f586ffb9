"""Secrets the rendered pods read, always as env from a secretKeyRef, never on a command line
(argv shows in `ps`, in the pod spec's command, and in every log that prints it).

  TANDEM_API_KEY         workers and router   spec.apiKeySecretRef {name, key}  (the user's Secret)
  TANDEM_WORKER_API_KEY  router               the same Secret: the key it sends to the workers
  TANDEM_PD_SECRET       prefill and decode   <name>-pd-secret, which the operator creates (pd_secret.py)

These Secrets, and only these, may also be named by a pod template override (template_allowlist.py).
"""

from __future__ import annotations

from typing import Any

from tandem import worker_contract as contract
from tandem.operator import names
from tandem.operator.spec.secret_ref import SecretKeyRef


def secret_env(env_name: str, ref: SecretKeyRef) -> dict[str, Any]:
    return {"name": env_name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}


def worker_secret_env(instance: str, api_key: SecretKeyRef | None) -> list[dict[str, Any]]:
    env = [contract.pd_secret_env(names.pd_secret_name(instance))]
    if api_key is not None:
        env.append(secret_env(contract.ENV_API_KEY, api_key))
    return env


def router_secret_env(api_key: SecretKeyRef | None) -> list[dict[str, Any]]:
    # Workers and router share one key here, so the router forwards the key it also requires.
    if api_key is None:
        return []
    return [secret_env(contract.ENV_API_KEY, api_key), secret_env(contract.ENV_WORKER_API_KEY, api_key)]


def referenced_secrets(instance: str, api_key: SecretKeyRef | None) -> frozenset[str]:
    """Secret names the operator's own pods read: a template may mount or read these, no others."""
    found = {names.pd_secret_name(instance)}
    if api_key is not None:
        found.add(api_key.name)
    return frozenset(found)
