"""Names, labels and ports shared by every child manifest.

The worker ports and paths come from tandem.worker_contract, which `tandem serve`
implements; docs/operator.md lists them for the engine side.
"""

from __future__ import annotations

from tandem import worker_contract as contract

GROUP = "tandem.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAME = "tisvc"

# The Gateway API Inference Extension's pool and Gateway API's route (render/gateway.py).
INFERENCE_POOL_API_VERSION = "inference.networking.k8s.io/v1"
HTTP_ROUTE_API_VERSION = "gateway.networking.k8s.io/v1"

FIELD_MANAGER = "tandem-operator"
MANAGED_BY = "tandem-operator"
APP_NAME = "tandem"

# Longest CR name whose longest child name ("<name>-prefill-headless" is not used;
# "<name>-internal-kv" is the longest) still fits a 63-character DNS label.
MAX_NAME_LENGTH = 40

# The worker's side of these (ports, paths, roles) is tandem.worker_contract's: one place
# knows how a worker is started, and the operator renders from it.
HTTP_PORT = contract.HTTP_PORT
BOOTSTRAP_PORT = contract.BOOTSTRAP_PORT
ENGINE_CONFIG_DIR = contract.ENGINE_CONFIG_DIR
ENGINE_CONFIG_FILE = contract.ENGINE_CONFIG_FILE
MODEL_MOUNT = contract.MODEL_MOUNT

# The router's Endpoint Picker listener (spec.gateway; the port is the CR's, this the default).
EPP_PORT = contract.EPP_PORT
EPP_PORT_NAME = contract.EPP_PORT_NAME

HEALTH_PATH = contract.HEALTH_PATH
READY_PATH = contract.READY_PATH
METRICS_PATH = contract.METRICS_PATH
DRAIN_PATH = contract.DRAIN_PATH

PREFILL = contract.PREFILL
DECODE = contract.DECODE
ROUTER = "router"
WORKER_ROLES = (PREFILL, DECODE)
ROLES = (PREFILL, DECODE, ROUTER)

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
# The model generation (rollout/generation_hash.py): worker Deployments select on it, so each generation's
# pods belong to that generation's Deployment only, and the router pairs within one generation.
LABEL_GENERATION = contract.GENERATION_LABEL
GENERATION_LENGTH = 10


def selector_labels(instance: str, role: str | None = None) -> dict[str, str]:
    """The immutable labels a Deployment selects on; never add mutable values here."""
    labels = {LABEL_NAME: APP_NAME, LABEL_INSTANCE: instance}
    if role is not None:
        labels[LABEL_COMPONENT] = role
    return labels


def standard_labels(instance: str, role: str | None = None) -> dict[str, str]:
    return {**selector_labels(instance, role), LABEL_PART_OF: APP_NAME, LABEL_MANAGED_BY: MANAGED_BY}


def selector_string(labels: dict[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in labels.items())


def role_name(instance: str, role: str) -> str:
    """Headless Service and PDB name of one role (all generations)."""
    return f"{instance}-{role}"


def generation_name(instance: str, role: str, generation: str) -> str:
    """A worker Deployment of one generation, and the prefill Service decode pods of that
    generation handshake with: at most 40 + 9 + GENERATION_LENGTH = 59 characters."""
    return f"{instance}-{role}-{generation}"


def router_service_name(instance: str) -> str:
    # The client-facing Service carries the plain CR name, so the URL reads naturally.
    return instance


def inference_pool_name(instance: str) -> str:
    # Named like the router Service: one service, one pool; the kinds differ, so the names never clash.
    return instance


def http_route_name(instance: str) -> str:
    return instance


def epp_service_name(instance: str) -> str:
    """The router's Endpoint Picker port, on a ClusterIP Service apart from the client-facing one."""
    return f"{instance}-epp"


def router_account_name(instance: str) -> str:
    return f"{instance}-router"


def engine_config_name(instance: str, generation: str) -> str:
    # Per generation: pods of an old generation restarting mid-rollout must read the old config.
    return f"{instance}-engine-{generation}"


def pd_secret_name(instance: str) -> str:
    """The Secret the operator creates once per InferenceService: the prefill<->decode control key."""
    return f"{instance}-pd-secret"


PD_SECRET_KEY = contract.PD_SECRET_KEY  # the data key holding the Z85 text


def network_policy_name(instance: str) -> str:
    return f"{instance}-internal-kv"


def gateway_network_policy_name(instance: str) -> str:
    """The NetworkPolicy that admits the gateway's proxy to the decode pods (spec.gateway.httpFromNamespaces)."""
    return f"{instance}-gateway"


def service_url(instance: str, namespace: str, port: int) -> str:
    suffix = "" if port == 80 else f":{port}"
    return f"http://{instance}.{namespace}.svc.cluster.local{suffix}"
