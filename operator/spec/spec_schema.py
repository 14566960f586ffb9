"""The openAPIV3Schema of the InferenceService spec.

This is the single source of the spec's defaults: the API server applies them on
admission, and `schema_defaults.apply_defaults` applies the same ones to a CR that did not
pass through an API server (`tandem operator render`, test emulators).
Objects that carry nested defaults default to `{}` so that those nested defaults apply.
"""

from __future__ import annotations

from tandem import worker_contract as contract
from tandem.operator.spec.field_checks import DNS_LABEL, DNS_SUBDOMAIN, GATEWAY_DURATION, HOSTNAME, NameRule
from tandem.operator.spec.schema_builders import (
    Schema,
    boolean,
    free_form,
    int_or_string,
    integer,
    number,
    obj,
    string,
    string_map,
)
from tandem.operator.spec.status_schema import STATUS_SCHEMA

QUANTITY_MAP: Schema = {"type": "object", "additionalProperties": int_or_string()}

RESOURCES = obj(
    {"limits": QUANTITY_MAP, "requests": QUANTITY_MAP},
    desc="Container resources. GPUs are `nvidia.com/gpu`; when unset on a worker the operator "
    "requests tensorParallelSize GPUs.",
)

TOLERATION = obj({
    "key": string(),
    "operator": string(enum=("Exists", "Equal")),
    "value": string(),
    "effect": string(enum=("NoSchedule", "PreferNoSchedule", "NoExecute")),
    "tolerationSeconds": {"type": "integer", "format": "int64"},
})


def role_schema(role: str, *, worker: bool) -> Schema:
    props: dict[str, Schema] = {
        "replicas": integer(0, 1000, 1, f"Initial (or, without autoscaling, fixed) number of {role} pods."),
        "minReplicas": integer(0, 1000, 1, "Lower bound for the autoscaler."),
        "maxReplicas": integer(1, 1000, 8, "Upper bound for the autoscaler."),
        "image": string(desc="Overrides spec.image for this role."),
        "resources": RESOURCES,
        "nodeSelector": string_map("Node labels the pods must match."),
        "tolerations": {"type": "array", "items": TOLERATION},
        "extraArgs": {"type": "array", "items": {"type": "string"},
                      "description": "Appended to the command."},
        "template": free_form(
            "Pod template overrides ({metadata, spec}), merged onto the generated template: "
            "maps merge recursively, lists of named items (containers, env, volumes, ...) merge by name."
        ),
    }
    if worker:
        props["tensorParallelSize"] = integer(1, 64, 1, "GPUs per pod that one model replica spans.")
        props["expertParallelSize"] = integer(1, 64, 1, (
            "Expert parallelism for a mixture-of-experts model: 1 (each GPU holds a share of every "
            "expert), or tensorParallelSize (each GPU holds whole experts). It runs on the tensor-parallel "
            "ranks, so the pod's GPUs stay tensorParallelSize."))
        props["hostCacheGiB"] = number(0, 4096, 0, (
            "Host memory (GiB, per pod) for a KV cache tier under the device pool (--enable-hierarchical-cache): "
            "prefixes the device evicts are kept there and loaded back instead of recomputed. 0: no tier. "
            "The pod's memory request (and limit, where set) grows by it; each tensor-parallel rank holds "
            "its share."))
        props["drainTimeoutSeconds"] = integer(
            0, 3600, 120, "How long preStop waits for in-flight requests; the grace period adds 30 s.")
        props["startupTimeoutSeconds"] = integer(30, 7200, 900, "Model load budget before liveness applies.")
        props["rollout"] = obj({
            "maxSurge": int_or_string(desc="Overrides spec.rollout.maxSurge for this role."),
            "maxUnavailable": int_or_string(desc="Overrides spec.rollout.maxUnavailable for this role."),
        }, desc="Per-role rollout budget; unset fields come from spec.rollout.")
    else:
        props["tensorParallelSize"] = integer(1, 1, 1, "The router runs no model.")
        props["serviceType"] = string(enum=("ClusterIP", "NodePort", "LoadBalancer"), default="ClusterIP")
        props["servicePort"] = integer(1, 65535, 80, "Port of the client-facing Service.")
    rules = [("self.minReplicas <= self.maxReplicas", f"{role}.minReplicas must not exceed {role}.maxReplicas")]
    if worker:
        rules.append(("self.expertParallelSize == 1 || self.expertParallelSize == self.tensorParallelSize",
                      f"{role}.expertParallelSize must be 1 or {role}.tensorParallelSize"))
    return obj(props, default={}, rules=tuple(rules))


MODEL = obj(
    {
        "servedName": string(min_length=1, max_length=128, desc="Model name clients send in requests."),
        "pvc": obj({
            "claimName": string(min_length=1, max_length=253),
            "path": string(default="", desc="Directory of the model inside the claim."),
        }, required=("claimName",)),
        "hostPath": obj({"path": string(min_length=1, desc="Absolute model directory on the node.")},
                        required=("path",)),
        "uri": string(desc="Reserved for a later release (hf://, s3://); rejected by the operator today."),
        "toolCallParser": string(enum=contract.TOOL_CALL_PARSERS, desc=(
            "How the workers read tool calls out of chat answers; unset: the format the model's chat "
            "template names.")),
        "reasoningParser": string(enum=contract.REASONING_PARSERS, desc=(
            "Split a reasoning model's thinking into reasoning_content; unset: answers are left whole.")),
        "heads": obj({
            "attention": integer(1, 4096, desc="num_attention_heads in the model's config.json."),
            "keyValue": integer(1, 4096, desc="num_key_value_heads in config.json; unset: as many as attention."),
        }, required=("attention",), desc=(
            "The model's head counts, when known. The operator then refuses a tensorParallelSize the "
            "engine would refuse (it must divide the attention heads, and the KV heads must divide by it "
            "or divide it) before any pod starts; unset, the worker refuses at start and the error "
            "shows in the WorkersFailing condition.")),
    },
    required=("servedName",),
    rules=((
        "[has(self.pvc), has(self.hostPath), has(self.uri)].filter(x, x).size() == 1",
        "model needs exactly one of pvc, hostPath or uri",
    ),),
)

ENGINE = obj(
    {
        "pageSize": integer(1, 1024, desc="Tokens per KV page (SGLang page_size)."),
        "chunkedPrefillSize": integer(-1, 1048576, desc="Prefill chunk in tokens; -1 disables chunking."),
        "maxPrefillTokens": integer(1, 1048576),
        "maxTotalTokens": integer(1, 134217728),
        "maxRunningRequests": integer(1, 65536),
        "schedulePolicy": string(enum=("fcfs", "lpm", "dfs-weight", "lof", "random")),
        "disableOverlapSchedule": boolean(),
        "enableMixedChunk": boolean(),
        "disableRadixCache": boolean(),
        "deterministic": boolean(desc="The same request gets the same tokens whatever its batch and cache "
                                             "hits (CPU workers; docs/engine.md, Deterministic mode)."),
        "dtype": string(enum=("auto", "float16", "bfloat16", "float32", "half")),
        "memFractionStatic": number(0.05, 0.99),
        "kvCacheDtype": string(enum=("auto", "fp8_e4m3", "fp8_e5m2"), desc=(
            "How the KV pool stores K and V: the model's dtype, or a byte a value (docs/engine.md, FP8 KV "
            "cache). One field for both roles: a prefill and a decode must store KV alike.")),
        "extra": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                  "description": "Further engine args, written to engine.yaml as given (snake_case keys)."},
    },
    default={},
    desc="Engine args, written to /etc/tandem/engine.yaml in SGLang's snake_case names.",
)

KV_TRANSFER = obj(
    {
        "backend": string(enum=("nixl",), default="nixl"),
        "ucx": obj({
            "transports": {"type": "array", "items": {"type": "string"},
                           "description": "UCX_TLS, e.g. [rc, cuda_copy, cuda_ipc, tcp]; keep tcp last as the "
                                          "fallback where RDMA is missing. Empty lets UCX choose."},
            "devices": {"type": "array", "items": {"type": "string"},
                        "description": "UCX_NET_DEVICES, e.g. [mlx5_0:1]; empty lets UCX choose."},
        }, default={}),
        "portBase": integer(1024, 64000, 17000, "First KV/ZMQ port; the range is kept in-namespace."),
        "portCount": integer(1, 1024, 64),
    },
    default={},
)


def scaling_rule(role: str) -> Schema:
    return obj({
        "signal": string(enum=("queueDepth", "kvUtilization", "ttftP95", "itlP95"),
                         default="queueDepth" if role == "prefill" else "kvUtilization"),
        "target": number(0, exclusive_min=True, desc=(
            "Per-replica target: queued requests, KV fraction (0..1) or seconds. Defaults: "
            "queueDepth 4 (requests waiting or running per pod), kvUtilization 0.75, "
            "latency signals the matching spec.slo target.")),
    }, default={})


def step_rules(stabilization: int, cooldown: int, step: int) -> Schema:
    return obj({
        "stabilizationWindowSeconds": integer(0, 3600, stabilization),
        "cooldownSeconds": integer(0, 3600, cooldown),
        "maxStep": integer(1, 100, step, "Most pods added or removed per role in one decision."),
    }, default={})


AUTOSCALING = obj(
    {
        "enabled": boolean(False),
        "metricsSource": obj({
            "type": string(enum=("scrape", "prometheus"), default="scrape"),
            "prometheusUrl": string(desc="e.g. http://prometheus-operated.monitoring:9090"),
        }, default={}, rules=((
            "self.type != 'prometheus' || has(self.prometheusUrl)",
            "metricsSource.prometheusUrl is required when type is prometheus",
        ),)),
        "prefill": scaling_rule("prefill"),
        "decode": scaling_rule("decode"),
        "tolerance": number(0, 1, 0.1, "Relative deviation from target ignored as noise."),
        "ratio": obj({
            "min": number(0.01, 100, 0.25, exclusive_min=False, desc="Lowest prefill:decode pod ratio."),
            "max": number(0.01, 100, 4.0, desc="Highest prefill:decode pod ratio."),
        }, default={}, rules=(("self.min <= self.max", "autoscaling.ratio.min must not exceed ratio.max"),)),
        "external": {"type": "array", "items": {"type": "string", "enum": ["prefill", "decode"]},
                     "x-kubernetes-list-type": "set", "description":
                     "Roles an external autoscaler (HPA, KEDA) drives through their RoleScaler's /scale; "
                     "the built-in autoscaler leaves them alone, and the P:D ratio still holds."},
        "scaleUp": step_rules(30, 60, 2),
        "scaleDown": step_rules(300, 180, 1),
    },
    default={},
)

SLO = obj({
    "ttftP95Seconds": number(0, exclusive_min=True, desc="Target p95 time to first token."),
    "itlP95Seconds": number(0, exclusive_min=True, desc="Target p95 inter-token latency."),
}, default={})

ROLLOUT = obj({
    "maxSurge": int_or_string(1),
    "maxUnavailable": int_or_string(0, "0 by default so a rollout never drops serving capacity."),
}, default={})

API_KEY_SECRET_REF = obj(
    {"name": string(min_length=1, max_length=253), "key": string(min_length=1, max_length=253)},
    required=("name", "key"),
    desc="A Secret in this namespace holding the API key workers and router require (Bearer); the pods read "
    "it as env TANDEM_API_KEY, and the router sends it to the workers. Unset: no key is required.",
)


def _named(rule: NameRule, desc: str) -> Schema:
    return string(min_length=1, max_length=rule.max_length, pattern=rule.pattern, desc=desc)


# GIE's EndpointPickerFailureMode; FailClose is its default as well.
FAILURE_MODES = ("FailClose", "FailOpen")
MAX_HOSTNAMES = 16  # as Gateway API's HTTPRoute allows
MAX_HTTP_FROM_NAMESPACES = 16
# The route's request timeout: the router's own (router/config.py request_timeout, 600 s), so a long
# generation gets the same budget through the gateway as through the router. Gateways default to far
# less (Envoy Gateway: 15 s), which cuts a long answer off mid-stream.
ROUTE_REQUEST_TIMEOUT = "600s"

GATEWAY = obj(
    {
        "inferencePool": obj({
            "enabled": boolean(True, "Render an InferencePool (inference.networking.k8s.io/v1) named after the "
                                     "service, selecting its decode pods, with the router as its Endpoint Picker."),
            "eppPort": integer(1, 65535, contract.EPP_PORT, "The router's Endpoint Picker (Envoy ext-proc, gRPC) "
                               "port: `tandem router --epp-port`, on the router pods and on the ClusterIP "
                               "Service <name>-epp the pool names."),
            "failureMode": string(enum=FAILURE_MODES, default="FailClose", desc=(
                "What the gateway does while the Endpoint Picker does not answer: FailClose refuses the "
                "request, FailOpen sends it to a pod of the gateway's own choosing.")),
        }, default={}),
        "httpRoute": obj({
            "parentRef": obj({
                "name": _named(DNS_SUBDOMAIN, "The Gateway's name."),
                "namespace": _named(DNS_LABEL, "The Gateway's namespace; unset: this InferenceService's. "
                                    "Its listener must allow routes from this namespace."),
                "sectionName": _named(DNS_SUBDOMAIN, "One listener of the Gateway; unset: every listener."),
            }, required=("name",)),
            "hostnames": {"type": "array", "maxItems": MAX_HOSTNAMES, "x-kubernetes-list-type": "atomic",
                          "items": _named(HOSTNAME, "e.g. llm.example.com or *.example.com"),
                          "description": "Host headers the route matches; unset: those of the listener."},
            "requestTimeout": string(
                default=ROUTE_REQUEST_TIMEOUT, min_length=1, max_length=GATEWAY_DURATION.max_length,
                pattern=GATEWAY_DURATION.pattern, desc=(
                    "The route rule's timeouts.request: how long the gateway lets one request take, a "
                    "streamed answer included, as a Gateway API duration (e.g. 600s, 20m). \"0s\" asks the "
                    "gateway for no timeout (one that cannot go without uses its longest). Default: the "
                    "router's own request timeout, 600s.")),
        }, required=("parentRef",), desc=(
            "Also render an HTTPRoute (gateway.networking.k8s.io/v1) named after the service, from this "
            "Gateway to the InferencePool, for every path.")),
        "httpFromNamespaces": {
            "type": "array", "maxItems": MAX_HTTP_FROM_NAMESPACES, "x-kubernetes-list-type": "atomic",
            "items": _named(DNS_LABEL, "A namespace name."),
            "description": (
                "Namespaces whose pods may reach the decode pods' HTTP port (8000), where the gateway's proxy "
                "sends requests: a NetworkPolicy <name>-gateway admits them, on that port only. "
                "httpRoute.parentRef.namespace is admitted too, as the namespace Istio and kgateway run a "
                "Gateway's proxy pods in. Name the proxy's namespace here when it runs elsewhere (Envoy "
                "Gateway's default: its own, envoy-gateway-system)."),
        },
    },
    rules=((
        "!has(self.httpRoute) || self.inferencePool.enabled",
        "gateway.httpRoute needs gateway.inferencePool.enabled: the route's backend is the InferencePool",
    ),),
    desc=("Serve through a Gateway API Inference Extension gateway: the gateway sends each request to the "
          "decode pod the router's Endpoint Picker names. Unset: no gateway objects. Needs GIE's CRDs "
          "(and Gateway API's for httpRoute) in the cluster."),
)

SPEC_SCHEMA = obj(
    {
        "model": MODEL,
        "image": string(min_length=1, desc="Runtime image with the `tandem` console script."),
        "imagePullPolicy": string(enum=("Always", "IfNotPresent", "Never"), default="IfNotPresent"),
        "imagePullSecrets": {"type": "array", "items": obj({"name": string()}, required=("name",))},
        "apiKeySecretRef": API_KEY_SECRET_REF,
        "engine": ENGINE,
        "prefill": role_schema("prefill", worker=True),
        "decode": role_schema("decode", worker=True),
        "router": role_schema("router", worker=False),
        "kvTransfer": KV_TRANSFER,
        "autoscaling": AUTOSCALING,
        "slo": SLO,
        "rollout": ROLLOUT,
        "gateway": GATEWAY,
    },
    required=("model", "image"),
)

ROOT_SCHEMA: Schema = {
    "type": "object",
    "required": ["spec"],
    "properties": {
        "apiVersion": {"type": "string"},
        "kind": {"type": "string"},
        "metadata": {"type": "object"},
        "spec": SPEC_SCHEMA,
        "status": STATUS_SCHEMA,
    },
    "x-kubernetes-validations": [{
        "rule": "self.metadata.name.size() <= 40",
        "message": "metadata.name must be at most 40 characters so child names fit DNS labels",
    }],
}
