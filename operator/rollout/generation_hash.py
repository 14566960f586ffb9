"""The model generation: a hash of everything that makes prefill and decode pods compatible.

Two pods may exchange KV only if they run the same image, weights, served name, engine
arguments (page size, dtype, ...), KV transfer settings and tensor parallel layout. Any
change to those starts a new generation, which the operator rolls out as a pair of
Deployments (step.py); changes that leave pods compatible (resources, node selectors,
template overrides, extra args) roll within a generation's Deployment as usual.
"""

from __future__ import annotations

import hashlib
import json

from tandem.operator import names
from tandem.operator.spec.service_spec import ServiceSpec


def generation_of(svc: ServiceSpec) -> str:
    compatible = {
        "images": [svc.prefill.image, svc.decode.image],
        "model": [svc.model.served_name, svc.model.pvc_claim, svc.model.pvc_path, svc.model.host_path],
        "engine": svc.engine_args,
        "kv": [svc.kv.backend, svc.kv.port_base, svc.kv.port_count, list(svc.kv.transports), list(svc.kv.devices)],
        "tp": [svc.prefill.tensor_parallel_size, svc.decode.tensor_parallel_size],
    }
    digest = hashlib.sha256(json.dumps(compatible, sort_keys=True, default=str).encode()).hexdigest()
    # Hex may start with a digit, which is fine inside a name that starts with the CR's name.
    return digest[: names.GENERATION_LENGTH]
