"""The engine-args ConfigMap: one engine.yaml per worker role.

Each role gets its own key because tensor parallel size is per role; the worker
Deployment mounts its role's key as /etc/tandem/engine.yaml. There is one ConfigMap per
model generation (rollout/generation_hash.py), so an old generation's pod that restarts mid-rollout
still reads the config it is compatible with.
"""

from __future__ import annotations

import hashlib
from typing import Any

from tandem.operator import names
from tandem.operator.child_meta import child_meta
from tandem.operator.spec.service_spec import ServiceSpec
from tandem.worker_contract import DECODE, PREFILL, EngineYaml, KvTransfer

CONFIG_HASH_ANNOTATION = "tandem.dev/engine-config-hash"


def role_engine_yaml(svc: ServiceSpec, role: str, generation: str) -> str:
    """The role's engine.yaml, in the worker contract's schema (`tandem serve` parses it back).
    Decode pods handshake with the prefill pods' headless Service at start: their readiness
    waits for it (and follows it through heartbeats), so no decode pod takes traffic it
    cannot serve disaggregated. The Service is the generation's own: a decode pod never
    handshakes with a prefill pod it cannot exchange KV with."""
    args = dict(svc.engine_args)
    spec = svc.role(role)
    if spec.expert_parallel_size > 1:
        args["ep_size"] = spec.expert_parallel_size
    if spec.host_cache_gib > 0:  # the pod's host tier, shared by its ranks (each runs its own)
        args["enable_hierarchical_cache"] = True
        args["hicache_size"] = spec.host_cache_gib / spec.tensor_parallel_size
    if role == DECODE:
        prefill = f"{names.generation_name(svc.name, PREFILL, generation)}.{svc.namespace}.svc.cluster.local"
        args.setdefault("pd_prefill_peers", f"{prefill}:{names.BOOTSTRAP_PORT}")
    return EngineYaml(
        engine_args=args,
        tp_size=svc.role(role).tensor_parallel_size,
        kv_transfer=KvTransfer(backend=svc.kv.backend, port_base=svc.kv.port_base, port_count=svc.kv.port_count),
    ).render()


def config_key(role: str) -> str:
    return f"{role}.yaml"


def config_hash(svc: ServiceSpec, role: str, generation: str) -> str:
    return hashlib.sha256(role_engine_yaml(svc, role, generation).encode()).hexdigest()[:16]


def engine_configmap(svc: ServiceSpec, generation: str) -> dict[str, Any]:
    meta = child_meta(svc, names.engine_config_name(svc.name, generation))
    meta["labels"][names.LABEL_GENERATION] = generation
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta,
        "data": {config_key(role): role_engine_yaml(svc, role, generation) for role in names.WORKER_ROLES},
    }
