"""The worker Deployments grouped by model generation, and the API calls that step old ones.

Old generations are not re-rendered (the current spec no longer describes them): their
Deployments are only scaled, with a merge patch of spec.replicas, and deleted with their
ConfigMap and prefill Service once no pod of theirs is left. A Deployment from before
generations existed (named `<name>-<role>`, no generation label) is an old generation "".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.operator import names
from tandem.operator.child_meta import is_owned_by
from tandem.operator.kubeapi import KubeApi
from tandem.operator.rollout.step import GenCounts, Step
from tandem.operator.status import RoleObserved, observe_deployment

ROLE_INDEX = {names.PREFILL: 0, names.DECODE: 1}


@dataclass
class Generation:
    name: str
    created: str = ""  # the oldest Deployment's creationTimestamp: orders old generations
    deployments: dict[str, dict[str, Any]] = field(default_factory=dict)  # role -> Deployment

    def counts(self) -> GenCounts:
        obs = {role: observe_deployment(self.deployments.get(role)) for role in names.WORKER_ROLES}
        replicas = {role: int(((self.deployments.get(role) or {}).get("spec") or {}).get("replicas") or 0)
                    for role in names.WORKER_ROLES}
        return GenCounts(self.name, (replicas[names.PREFILL], replicas[names.DECODE]),
                         (obs[names.PREFILL].ready, obs[names.DECODE].ready))

    def children(self, instance: str) -> list[tuple[str, str, str]]:
        """(apiVersion, kind, name) of everything this generation's pods need: its Deployments,
        the ConfigMap they mount and the prefill Service its decode pods handshake with. The
        generation from before labels ("") mounted `<name>-engine` and shares the role Services."""
        out = [("apps/v1", "Deployment", d["metadata"]["name"]) for d in self.deployments.values()]
        if not self.name:
            return [*out, ("v1", "ConfigMap", f"{instance}-engine")]
        return [*out, ("v1", "ConfigMap", names.engine_config_name(instance, self.name)),
                ("v1", "Service", names.generation_name(instance, names.PREFILL, self.name))]

    def empty(self) -> bool:
        """No pods left and none wanted: safe to delete."""
        return all(observe_deployment(d).replicas == 0 and not (d.get("spec") or {}).get("replicas")
                   for d in self.deployments.values())


def group(deployments: list[dict[str, Any]], uid: str) -> dict[str, Generation]:
    out: dict[str, Generation] = {}
    for dep in deployments:
        meta = dep.get("metadata") or {}
        labels = meta.get("labels") or {}
        role = labels.get(names.LABEL_COMPONENT)
        if role not in ROLE_INDEX or not is_owned_by(dep, uid):
            continue
        gen = out.setdefault(labels.get(names.LABEL_GENERATION, ""), Generation(labels.get(names.LABEL_GENERATION, "")))
        gen.deployments[role] = dep
        created = str(meta.get("creationTimestamp") or "")
        gen.created = min(gen.created, created) if gen.created else created
    return out


def old_generations(gens: dict[str, Generation], current: str) -> list[Generation]:
    """Every generation but the current one, oldest first."""
    return sorted((g for name, g in gens.items() if name != current), key=lambda g: (g.created, g.name))


async def list_worker_deployments(api: KubeApi, namespace: str, instance: str) -> list[dict[str, Any]]:
    items = await api.list("apps/v1", "Deployment", namespace, names.selector_labels(instance))
    return [d for d in items if (d.get("metadata") or {}).get("labels", {}).get(names.LABEL_COMPONENT)
            in names.WORKER_ROLES]


async def scale_old(api: KubeApi, old: list[Generation], step: Step) -> None:
    for gen in old:
        want = step.old.get(gen.name, (0, 0))
        for role, dep in gen.deployments.items():
            replicas = want[ROLE_INDEX[role]]
            if (dep.get("spec") or {}).get("replicas") != replicas:
                meta = dep["metadata"]
                await api.merge_patch("apps/v1", "Deployment", meta["namespace"], meta["name"],
                                      {"spec": {"replicas": replicas}})


async def retire(api: KubeApi, namespace: str, instance: str, old: list[Generation]) -> list[str]:
    """Delete the old generations that have drained completely; returns what was removed."""
    removed = []
    for gen in old:
        if not gen.empty():
            continue
        for api_version, kind, name in gen.children(instance):
            await api.delete(api_version, kind, namespace, name)
            removed.append(f"{kind}/{name}")
    return removed


def observe_roles(gens: dict[str, Generation], current: str) -> dict[str, RoleObserved]:
    """Per worker role, summed over generations; `updated` counts the current generation only."""
    out = {}
    for role in names.WORKER_ROLES:
        parts = [(name, observe_deployment(g.deployments.get(role))) for name, g in gens.items()
                 if role in g.deployments]
        now = next((o for name, o in parts if name == current), RoleObserved())
        out[role] = RoleObserved(
            exists=now.exists,
            replicas=sum(o.replicas for _, o in parts),
            ready=sum(o.ready for _, o in parts),
            updated=now.updated if now.current_generation else 0,
            current_generation=all(o.current_generation for _, o in parts),
        )
    return out
