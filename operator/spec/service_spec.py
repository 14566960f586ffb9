"""Typed, validated view of an InferenceService: frozen dataclasses built once per reconcile.

`parse_service` applies the schema defaults, then checks what the openAPI schema and
its CEL rules cannot express (or what a CR that skipped admission may violate).
Any problem raises `SpecError` with every message at once, which the operator turns
into a Degraded condition instead of a crash loop.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tandem.operator import names
from tandem.operator.spec.gateway import GatewaySpec, parse_gateway
from tandem.operator.spec.model_source import ModelSource, parse_model
from tandem.operator.spec.schema_defaults import default_spec
from tandem.operator.spec.secret_ref import SecretKeyRef, parse_secret_ref
from tandem.operator.spec.sections import (
    AutoscalingSpec,
    KvTransfer,
    RoleSpec,
    Rollout,
    SloSpec,
    SpecError,
    kv_dtype_problems,
    parse_autoscaling,
    parse_engine_args,
    parse_kv,
    parse_role,
    parse_rollout,
    parse_slo,
)
from tandem.operator.spec.tensor_parallel import tp_problems

_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")

__all__ = ["ServiceSpec", "SpecError", "parse_service"]


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    namespace: str
    uid: str
    generation: int
    model: ModelSource
    image: str
    image_pull_policy: str
    image_pull_secrets: tuple[str, ...]
    engine_args: dict[str, Any]  # snake_case, as written to engine.yaml
    prefill: RoleSpec
    decode: RoleSpec
    router: RoleSpec
    kv: KvTransfer
    autoscaling: AutoscalingSpec
    slo: SloSpec
    rollout: Rollout

    role_rollouts: dict[str, Rollout]  # per worker role, spec.rollout with the role's overrides
    api_key: SecretKeyRef | None = None  # spec.apiKeySecretRef: workers and router require this key
    gateway: GatewaySpec | None = None  # spec.gateway with its InferencePool on, else None

    def role(self, role: str) -> RoleSpec:
        return {names.PREFILL: self.prefill, names.DECODE: self.decode, names.ROUTER: self.router}[role]

    def rollout_of(self, role: str) -> Rollout:
        return self.role_rollouts.get(role, self.rollout)


def parse_service(cr: dict[str, Any]) -> ServiceSpec:
    """The CR as a ServiceSpec, or SpecError. Malformed input the checks below did not foresee
    (a string where a mapping belongs, a list for a number) is a SpecError too, never an
    exception out of the operator."""
    try:
        return _parse(cr)
    except SpecError:
        raise
    except (ValueError, TypeError, AttributeError, KeyError, IndexError) as exc:
        raise SpecError([f"the spec is malformed ({type(exc).__name__}: {exc})"]) from None


def _parse(cr: dict[str, Any]) -> ServiceSpec:
    if not isinstance(cr, dict) or not isinstance(cr.get("metadata") or {}, dict):
        raise SpecError(["metadata must be a mapping"])
    meta = cr.get("metadata") or {}
    raw = cr.get("spec")
    if not isinstance(raw, dict):
        raise SpecError(["spec is missing"])
    spec = default_spec(raw)
    errors: list[str] = []
    name = str(meta.get("name", ""))
    if not _DNS_LABEL.match(name) or len(name) > names.MAX_NAME_LENGTH:
        errors.append(f"metadata.name {name!r} must be a DNS label of at most {names.MAX_NAME_LENGTH} chars")
    image = spec.get("image")
    if not isinstance(image, str) or not image:
        errors.append("spec.image is required")
    model = parse_model(spec.get("model"), errors)
    slo = parse_slo(spec["slo"], errors)
    roles = {role: parse_role(role, spec[role], str(image or ""), errors) for role in names.ROLES}
    autoscaling = parse_autoscaling(spec["autoscaling"], slo, roles[names.PREFILL], roles[names.DECODE],
                                    errors)
    engine_args = parse_engine_args(spec["engine"], errors)
    errors += kv_dtype_problems(engine_args, roles)
    kv = parse_kv(spec["kvTransfer"], errors)
    rollout = parse_rollout(spec["rollout"], errors)
    api_key = parse_secret_ref(spec.get("apiKeySecretRef"), "spec.apiKeySecretRef", errors)
    gateway = parse_gateway(spec.get("gateway"), errors)
    if model is not None:
        errors += tp_problems(model.heads, {r: roles[r].tensor_parallel_size for r in names.WORKER_ROLES})
    role_rollouts = {
        role: parse_rollout({**spec["rollout"], **(spec[role].get("rollout") or {})}, errors, f"spec.{role}.rollout")
        for role in names.WORKER_ROLES
    }
    if errors or model is None or autoscaling is None:
        raise SpecError(errors or ["spec is invalid"])
    return ServiceSpec(
        name=name,
        namespace=str(meta.get("namespace") or "default"),
        uid=str(meta.get("uid") or ""),
        generation=int(meta.get("generation") or 0),
        model=model,
        image=str(image),
        image_pull_policy=str(spec["imagePullPolicy"]),
        image_pull_secrets=tuple(str(s.get("name")) for s in spec.get("imagePullSecrets") or ()),
        engine_args=engine_args,
        prefill=roles[names.PREFILL],
        decode=roles[names.DECODE],
        router=roles[names.ROUTER],
        kv=kv,
        autoscaling=autoscaling,
        slo=slo,
        rollout=rollout,
        role_rollouts=role_rollouts,
        api_key=api_key,
        gateway=gateway,
    )
