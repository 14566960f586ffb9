"""The sections of a ServiceSpec (roles, KV transfer, autoscaling, SLO, rollout; the model's is
model_source.py) and their parsers; each parser appends problems to `errors`.

Parsers take the already-defaulted spec sections, so every key with a schema default
is present; type checks remain because a CR that skipped admission may hold anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.operator import names
from tandem.operator.spec.field_checks import (
    MAX_HOST_CACHE_GIB,
    MAX_REPLICAS,
    MAX_SECONDS,
    MAX_TENSOR_PARALLEL,
    _int,
    _num,
)
from tandem.operator.spec.pd_ratio import ratio_feasible
from tandem.operator.spec.spec_schema import ENGINE

GPU = "nvidia.com/gpu"
DEFAULT_TARGETS = {"queueDepth": 4.0, "kvUtilization": 0.75}

# CRD camelCase field -> SGLang server-arg name written to engine.yaml.
ENGINE_ARG_NAMES = {
    "pageSize": "page_size",
    "chunkedPrefillSize": "chunked_prefill_size",
    "maxPrefillTokens": "max_prefill_tokens",
    "maxTotalTokens": "max_total_tokens",
    "maxRunningRequests": "max_running_requests",
    "schedulePolicy": "schedule_policy",
    "disableOverlapSchedule": "disable_overlap_schedule",
    "enableMixedChunk": "enable_mixed_chunk",
    "disableRadixCache": "disable_radix_cache",
    "deterministic": "deterministic",
    "dtype": "dtype",
    "memFractionStatic": "mem_fraction_static",
    "kvCacheDtype": "kv_cache_dtype",
}


class SpecError(ValueError):
    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


@dataclass(frozen=True)
class RoleSpec:
    role: str
    replicas: int
    min_replicas: int
    max_replicas: int
    image: str
    resources: dict[str, Any]
    node_selector: dict[str, str]
    tolerations: tuple[dict[str, Any], ...]
    extra_args: tuple[str, ...]
    template: dict[str, Any]
    tensor_parallel_size: int
    drain_timeout_s: int
    startup_timeout_s: int
    service_type: str
    service_port: int
    expert_parallel_size: int = 1  # 1, or tensor_parallel_size (EP runs on the TP ranks)
    host_cache_gib: float = 0.0  # the pod's KV host tier (engine: hicache_size per rank), 0: none


@dataclass(frozen=True)
class KvTransfer:
    backend: str
    transports: tuple[str, ...]
    devices: tuple[str, ...]
    port_base: int
    port_count: int


@dataclass(frozen=True)
class ScalingRule:
    signal: str
    target: float


@dataclass(frozen=True)
class StepRule:
    stabilization_s: int
    cooldown_s: int
    max_step: int


@dataclass(frozen=True)
class AutoscalingSpec:
    enabled: bool
    source: str
    prometheus_url: str | None
    prefill: ScalingRule
    decode: ScalingRule
    tolerance: float
    ratio_min: float
    ratio_max: float
    up: StepRule
    down: StepRule
    external: tuple[str, ...] = ()  # roles HPA/KEDA drive through their RoleScaler


@dataclass(frozen=True)
class SloSpec:
    ttft_p95_s: float | None
    itl_p95_s: float | None


@dataclass(frozen=True)
class Rollout:
    max_surge: int | str
    max_unavailable: int | str


def _gpu_limit(resources: dict[str, Any]) -> int | None:
    value = (resources.get("limits") or {}).get(GPU)
    try:
        return None if value is None else int(str(value))
    except ValueError:
        return None


# Flags the operator writes itself (tandem/worker_contract.py): the Services, probes and the
# preStop drain are built on their values, so an extraArgs copy (argparse keeps the last one)
# would leave a pod that the Service misses or whose drain calls the wrong admin port.
OWNED_FLAGS = {
    names.ROUTER: ("--host", "--port", "--admin-port", "--model", "--model-name", "--namespace", "--selector",
                   "--prefill-selector", "--decode-selector", "--workers", "--prefill", "--decode",
                   "--epp-port"),  # from spec.gateway: the InferencePool and the EPP Service name its port
    "worker": ("--role", "--model", "--served-model-name", "--host", "--port", "--bootstrap-port", "--admin-port",
               "--config"),
}


def _check_extra_args(role: str, args: tuple[str, ...], errors: list[str]) -> None:
    owned = OWNED_FLAGS[names.ROUTER if role == names.ROUTER else "worker"]
    clash = sorted({a.split("=", 1)[0] for a in args} & set(owned))
    if clash:
        errors.append(f"spec.{role}.extraArgs may not set {', '.join(clash)}: the operator sets "
                      f"{'it' if len(clash) == 1 else 'them'} for the Services, probes and drain"
                      + ("; the EPP port is spec.gateway.inferencePool.eppPort" if "--epp-port" in clash else ""))


def parse_role(role: str, raw: dict[str, Any], image: str, errors: list[str]) -> RoleSpec:
    where = f"spec.{role}"
    spec = RoleSpec(
        role=role,
        replicas=_int(raw["replicas"], f"{where}.replicas", errors, hi=MAX_REPLICAS),
        min_replicas=_int(raw["minReplicas"], f"{where}.minReplicas", errors, hi=MAX_REPLICAS),
        max_replicas=_int(raw["maxReplicas"], f"{where}.maxReplicas", errors, lo=1, hi=MAX_REPLICAS),
        image=str(raw.get("image") or image),
        resources=dict(raw.get("resources") or {}),
        node_selector={str(k): str(v) for k, v in (raw.get("nodeSelector") or {}).items()},
        tolerations=tuple(raw.get("tolerations") or ()),
        extra_args=tuple(str(a) for a in raw.get("extraArgs") or ()),
        template=dict(raw.get("template") or {}),
        tensor_parallel_size=_int(raw["tensorParallelSize"], f"{where}.tensorParallelSize", errors, lo=1,
                                  hi=MAX_TENSOR_PARALLEL),
        drain_timeout_s=_int(raw.get("drainTimeoutSeconds", 0), f"{where}.drainTimeoutSeconds", errors,
                             hi=MAX_SECONDS),
        startup_timeout_s=_int(raw.get("startupTimeoutSeconds", 60), f"{where}.startupTimeoutSeconds", errors,
                               hi=MAX_SECONDS),
        service_type=str(raw.get("serviceType", "ClusterIP")),
        service_port=_int(raw.get("servicePort", 80), f"{where}.servicePort", errors, lo=1, hi=65535),
        expert_parallel_size=_int(raw.get("expertParallelSize", 1), f"{where}.expertParallelSize", errors, lo=1,
                                  hi=MAX_TENSOR_PARALLEL),
        host_cache_gib=_gib(raw.get("hostCacheGiB", 0), f"{where}.hostCacheGiB", errors),
    )
    if spec.expert_parallel_size not in (1, spec.tensor_parallel_size):  # a CR past admission
        errors.append(f"{where}.expertParallelSize {spec.expert_parallel_size} must be 1 or tensorParallelSize "
                      f"{spec.tensor_parallel_size}")
    _check_extra_args(role, spec.extra_args, errors)
    if not all(isinstance(spec.template.get(k, {}), dict) for k in ("metadata", "spec")):
        errors.append(f"{where}.template.metadata and {where}.template.spec must be mappings")
    if spec.min_replicas > spec.max_replicas:
        errors.append(f"{where}.minReplicas ({spec.min_replicas}) exceeds maxReplicas ({spec.max_replicas})")
    gpus = _gpu_limit(spec.resources)
    if role != names.ROUTER and gpus is not None and 0 < gpus < spec.tensor_parallel_size:
        errors.append(f"{where}: {GPU} limit {gpus} is below tensorParallelSize {spec.tensor_parallel_size}")
    return spec


def _rule(role: str, raw: dict[str, Any], slo: SloSpec, errors: list[str]) -> ScalingRule:
    signal = str(raw.get("signal"))
    target = raw.get("target")
    if target is None:
        latency = {"ttftP95": slo.ttft_p95_s, "itlP95": slo.itl_p95_s}
        target = DEFAULT_TARGETS.get(signal, latency.get(signal))
    if target is None:
        errors.append(f"spec.autoscaling.{role}: signal {signal} needs a target or a spec.slo target")
        target = 1.0
    if signal == "kvUtilization" and not 0 < float(target) <= 1:
        errors.append(f"spec.autoscaling.{role}.target for kvUtilization must be in (0, 1]")
    return ScalingRule(signal=signal, target=_num(target, f"spec.autoscaling.{role}.target", errors))


def _steps(raw: dict[str, Any]) -> StepRule:
    return StepRule(int(raw["stabilizationWindowSeconds"]), int(raw["cooldownSeconds"]), int(raw["maxStep"]))


def parse_autoscaling(raw: dict[str, Any], slo: SloSpec, prefill: RoleSpec, decode: RoleSpec,
                      errors: list[str]) -> AutoscalingSpec:
    source = raw["metricsSource"]
    ratio = raw["ratio"]
    spec = AutoscalingSpec(
        enabled=bool(raw["enabled"]),
        source=str(source["type"]),
        prometheus_url=source.get("prometheusUrl"),
        prefill=_rule(names.PREFILL, raw["prefill"], slo, errors),
        decode=_rule(names.DECODE, raw["decode"], slo, errors),
        tolerance=float(raw["tolerance"]),
        ratio_min=_num(ratio["min"], "spec.autoscaling.ratio.min", errors),
        ratio_max=_num(ratio["max"], "spec.autoscaling.ratio.max", errors),
        up=_steps(raw["scaleUp"]),
        down=_steps(raw["scaleDown"]),
        external=_roles(raw.get("external") or [], errors),
    )
    if spec.source == "prometheus" and not spec.prometheus_url:
        errors.append("spec.autoscaling.metricsSource.prometheusUrl is required for type prometheus")
    if not spec.enabled and not spec.external:
        return spec
    if spec.ratio_min > spec.ratio_max:
        errors.append("spec.autoscaling.ratio.min exceeds ratio.max")
    if not errors and not ratio_feasible((prefill.min_replicas, prefill.max_replicas),
                                         (decode.min_replicas, decode.max_replicas), spec.ratio_min, spec.ratio_max):
        errors.append(
            f"no prefill/decode counts within the replica bounds keep the P:D ratio in "
            f"[{spec.ratio_min}, {spec.ratio_max}]"
        )
    return spec


def _roles(raw: Any, errors: list[str]) -> tuple[str, ...]:
    if not isinstance(raw, list) or any(r not in names.WORKER_ROLES for r in raw):
        errors.append(f"spec.autoscaling.external must list roles among {list(names.WORKER_ROLES)}, got {raw!r}")
        return ()
    return tuple(dict.fromkeys(raw))


def parse_slo(raw: dict[str, Any], errors: list[str]) -> SloSpec:
    ttft, itl = raw.get("ttftP95Seconds"), raw.get("itlP95Seconds")
    return SloSpec(
        ttft_p95_s=None if ttft is None else _num(ttft, "spec.slo.ttftP95Seconds", errors),
        itl_p95_s=None if itl is None else _num(itl, "spec.slo.itlP95Seconds", errors),
    )


# The switches among them, as the CRD types them: a CR that skipped admission may hold "false".
ENGINE_SWITCHES = tuple(k for k, v in ENGINE["properties"].items() if v.get("type") == "boolean")


def parse_engine_args(raw: dict[str, Any], errors: list[str]) -> dict[str, Any]:
    args = {ENGINE_ARG_NAMES[key]: value for key, value in raw.items() if key in ENGINE_ARG_NAMES}
    errors += [f"spec.engine.{key} must be true or false, not {raw[key]!r:.40}"
               for key in ENGINE_SWITCHES if key in raw and not isinstance(raw[key], bool)]
    unknown = sorted(set(raw) - set(ENGINE_ARG_NAMES) - {"extra"})
    if unknown:
        errors.append(f"spec.engine has unknown fields {unknown}; put other engine args under engine.extra")
    extra = raw.get("extra") or {}
    clash = sorted(set(extra) & set(args))
    if clash:
        errors.append(f"spec.engine.extra repeats typed args {clash}")
    return {**args, **extra}


def _gib(value: Any, where: str, errors: list[str]) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_HOST_CACHE_GIB:
        errors.append(f"{where} must be a number of GiB in 0..{MAX_HOST_CACHE_GIB}, got {value!r:.40}")
        return 0.0
    return float(value)


def kv_dtype_problems(engine_args: dict[str, Any], roles: dict[str, RoleSpec]) -> list[str]:
    """An fp8 KV cache runs on CPU workers in this release: the engine refuses it on a GPU at
    start-up (FlashInfer's fp8-KV kernels are not wired in), so a CR asking for it on GPU
    workers gets this condition instead of pods that crash-loop."""
    dtype = engine_args.get("kv_cache_dtype", "auto")
    if dtype == "auto":
        return []
    on_gpus = [r for r in names.WORKER_ROLES if (_gpu_limit(roles[r].resources) or 0) > 0
               or _gpu_limit(roles[r].resources) is None]  # unset: the operator asks for TP GPUs
    return [f"spec.engine.kvCacheDtype {dtype} runs on CPU workers in this release ({', '.join(on_gpus)} "
            f"request GPUs; set their resources.limits.{GPU} to 0, or kvCacheDtype to auto)"] if on_gpus else []


def parse_kv(raw: dict[str, Any], errors: list[str]) -> KvTransfer:
    ucx = raw.get("ucx") or {}
    kv = KvTransfer(
        backend=str(raw["backend"]),
        transports=tuple(str(t) for t in ucx.get("transports") or ()),
        devices=tuple(str(d) for d in ucx.get("devices") or ()),
        port_base=_int(raw["portBase"], "spec.kvTransfer.portBase", errors, lo=1024),
        port_count=_int(raw["portCount"], "spec.kvTransfer.portCount", errors, lo=1),
    )
    if kv.backend != "nixl":
        errors.append(f"spec.kvTransfer.backend {kv.backend!r} is not supported; use nixl")
    overlap = kv.port_base <= names.HTTP_PORT < kv.port_base + kv.port_count
    if overlap or kv.port_base <= names.BOOTSTRAP_PORT < kv.port_base + kv.port_count:
        errors.append("spec.kvTransfer port range overlaps the http (8000) or bootstrap (8998) port")
    if kv.port_base + kv.port_count > 65536:
        errors.append("spec.kvTransfer port range runs past 65535")
    return kv


def _budget(value: Any, where: str, errors: list[str]) -> int | str:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_REPLICAS:
        return value
    if isinstance(value, str) and value.endswith("%") and value[:-1].isdigit() and int(value[:-1]) <= 100:
        return value
    errors.append(f"{where} must be a count or a percentage like '25%', got {value!r}")
    return 1


def parse_rollout(raw: dict[str, Any], errors: list[str], where: str = "spec.rollout") -> Rollout:
    rollout = Rollout(max_surge=_budget(raw["maxSurge"], f"{where}.maxSurge", errors),
                      max_unavailable=_budget(raw["maxUnavailable"], f"{where}.maxUnavailable", errors))
    if str(rollout.max_surge) in ("0", "0%") and str(rollout.max_unavailable) in ("0", "0%"):
        errors.append(f"{where}: maxSurge and maxUnavailable cannot both be 0")
    return rollout
