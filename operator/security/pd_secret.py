"""The prefill<->decode control channel key: one Secret per InferenceService, made once.

Prefill and decode pods read it as env TANDEM_PD_SECRET (secret_env.py) and authenticate
their control channel with it. It is not one of reconcile()'s children: those are re-applied
on every pass, and a key must not change under running pods (the pods of a rollout would hold
two keys). So sync() calls `ensure` before applying: an existing Secret is kept as it is, a
missing one is created with a fresh key (os.urandom, Z85-encoded). Its owner reference to the
InferenceService lets the garbage collector delete it with the CR; `immutable` keeps anyone
from editing the key in place.

A deleted Secret is recreated with a new key: pods started before then keep the old one
until they restart, so PD pairs across the two fail their handshake until a rollout.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from tandem.operator import names
from tandem.operator.child_meta import child_meta
from tandem.operator.kubeapi import ApiError, KubeApi
from tandem.operator.spec.service_spec import ServiceSpec
from tandem.pd.secret import check_pd_secret, new_pd_secret

KEY_LENGTH = 40  # Z85 of 32 bytes


def pd_secret(svc: ServiceSpec, key: str) -> dict[str, Any]:
    """The Secret holding `key` (pure: the caller draws the key)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": child_meta(svc, names.pd_secret_name(svc.name)),
        "type": "Opaque",
        "immutable": True,
        "data": {names.PD_SECRET_KEY: base64.b64encode(key.encode()).decode()},
    }


def key_problem(secret: dict[str, Any]) -> str | None:
    """Why an existing Secret cannot serve as the PD key (None: it can)."""
    raw = (secret.get("data") or {}).get(names.PD_SECRET_KEY)
    try:
        key = base64.b64decode(raw or "", validate=True).decode()
    except (binascii.Error, UnicodeDecodeError, TypeError, ValueError):
        key = ""
    try:
        check_pd_secret(key)
    except ValueError:
        name = (secret.get("metadata") or {}).get("name")
        return (f"Secret {name} holds no {KEY_LENGTH}-character Z85 key under {names.PD_SECRET_KEY!r}; "
                "delete it and the operator creates a new one")
    return None


async def ensure(api: KubeApi, svc: ServiceSpec) -> str | None:
    """Create the Secret unless it exists. Returns a problem with an existing one, else None."""
    name = names.pd_secret_name(svc.name)
    found = await api.get("v1", "Secret", svc.namespace, name)
    if found is None:
        try:
            found = await api.create(pd_secret(svc, new_pd_secret()))
        except ApiError as exc:
            if exc.status != 409:  # 409: another operator replica created it first; read theirs
                raise
            found = await api.get("v1", "Secret", svc.namespace, name) or {}
    return key_problem(found)
