"""spec.model: where the weights are, their head counts, and how the workers parse chat answers.
The parser appends problems to `errors`, as every section parser does (sections.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem import worker_contract as contract
from tandem.operator import names
from tandem.operator.spec.field_checks import _choice
from tandem.operator.spec.tensor_parallel import ModelHeads, parse_heads


@dataclass(frozen=True)
class ModelSource:
    served_name: str
    pvc_claim: str | None
    pvc_path: str
    host_path: str | None
    heads: ModelHeads | None = None  # spec.model.heads: lets reconcile check tensorParallelSize
    tool_call_parser: str | None = None  # spec.model.toolCallParser, on every worker's command line
    reasoning_parser: str | None = None

    @property
    def container_path(self) -> str:
        sub = self.pvc_path.strip("/") if self.pvc_claim else ""
        return f"{names.MODEL_MOUNT}/{sub}" if sub else names.MODEL_MOUNT


def parse_model(raw: Any, errors: list[str]) -> ModelSource | None:
    if not isinstance(raw, dict) or not raw.get("servedName"):
        errors.append("spec.model.servedName is required")
        return None
    sources = [key for key in ("pvc", "hostPath", "uri") if raw.get(key)]
    if len(sources) != 1:
        errors.append("spec.model needs exactly one of pvc, hostPath or uri")
        return None
    if sources == ["uri"]:
        errors.append("spec.model.uri is reserved for a later release; use model.pvc or model.hostPath")
        return None
    pvc, host = raw.get("pvc") or {}, raw.get("hostPath") or {}
    if sources == ["pvc"] and not pvc.get("claimName"):
        errors.append("spec.model.pvc.claimName is required")
    if sources == ["hostPath"] and not str(host.get("path", "")).startswith("/"):
        errors.append("spec.model.hostPath.path must be an absolute path")
    return ModelSource(
        served_name=str(raw["servedName"]),
        pvc_claim=str(pvc["claimName"]) if pvc.get("claimName") else None,
        pvc_path=str(pvc.get("path") or ""),
        host_path=str(host["path"]) if host.get("path") else None,
        heads=parse_heads(raw.get("heads"), errors),
        tool_call_parser=_choice(raw.get("toolCallParser"), contract.TOOL_CALL_PARSERS, "spec.model.toolCallParser",
                                 errors),
        reasoning_parser=_choice(raw.get("reasoningParser"), contract.REASONING_PARSERS,
                                 "spec.model.reasoningParser", errors),
    )
