"""A scripted Kubernetes API for one operator sync pass (httpx.MockTransport): it stores what
the operator applies, answers reads from that, and fails the calls a test scripts to fail.
Shared by the operator's sync, policy, rollout, scaling and secret tests."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import httpx
from operator_support import merge_patch

from tandem.operator.kubeapi import KubeApi
from tandem.operator.scaling.autoscale_round import ServiceMemory
from tandem.operator.security.operator_policy import OperatorPolicy
from tandem.operator.sync import sync

LOG = logging.getLogger("test")
Handler = Callable[[httpx.Request], httpx.Response]


class FakeApiServer:
    """Stores applied objects by path; optional failure injection per method+path fragment."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []
        self.fail: dict[str, tuple[int, str]] = {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.calls.append((request.method, path))
        for fragment, (code, reason) in self.fail.items():
            if fragment in f"{request.method} {path}":
                return httpx.Response(code, json={"kind": "Status", "reason": reason, "message": "injected"})
        if request.method == "PATCH" and request.headers["content-type"] == "application/merge-patch+json":
            if path.endswith("/status") and path[: -len("/status")] in self.objects:
                target = path[: -len("/status")]
                status = json.loads(request.content).get("status") or {}
                self.objects[target]["status"] = merge_patch(self.objects[target].get("status") or {}, status)
                return httpx.Response(200, json=self.objects[target])
            if path not in self.objects:
                return httpx.Response(404, json={"kind": "Status", "reason": "NotFound", "message": "nope"})
            self.objects[path] = merge_patch(self.objects[path], json.loads(request.content))
            return httpx.Response(200, json=self.objects[path])
        if request.method == "PATCH":
            assert request.headers["content-type"] == "application/apply-patch+yaml"
            assert request.url.params["fieldManager"] == "tandem-operator"
            assert request.url.params["force"] == "true"
            applied = json.loads(request.content)
            before = self.objects.get(path, {})
            if "status" in before:  # apply to the main resource never touches status
                applied["status"] = before["status"]
            # A field another manager set by merge patch (RoleScaler spec.replicas) survives an
            # apply that does not mention it, as server-side apply keeps others' fields.
            replicas = (before.get("spec") or {}).get("replicas")
            if replicas is not None and "replicas" not in (applied.get("spec") or {}):
                applied.setdefault("spec", {})["replicas"] = replicas
            self.objects[path] = applied
            return httpx.Response(200, json=self.objects[path])
        if request.method == "POST":  # a plain create: 409 when the object exists, as the API server says
            created = json.loads(request.content)
            target = f"{path}/{created['metadata']['name']}"
            if target in self.objects:
                return httpx.Response(409, json={"kind": "Status", "reason": "AlreadyExists", "message": "exists"})
            self.objects[target] = created
            return httpx.Response(201, json=created)
        if request.method == "GET" and path in self.objects:
            return httpx.Response(200, json=self.objects[path])
        if request.method == "GET" and "labelSelector" in request.url.params:
            items = [o for p, o in self.objects.items() if p.rsplit("/", 1)[0] == path]
            return httpx.Response(200, json={"items": items})
        if request.method == "DELETE":
            self.objects.pop(path, None)
            return httpx.Response(200, json={})
        return httpx.Response(404, json={"kind": "Status", "reason": "NotFound", "message": "nope"})


def run_sync(server: FakeApiServer, cr: dict[str, Any], **kwargs: Any) -> Any:
    async def go() -> Any:
        async with httpx.AsyncClient(base_url="http://api", transport=httpx.MockTransport(server)) as client:
            return await sync(cr, KubeApi(client), client, kwargs.get("memory") or ServiceMemory(), LOG,
                              autoscale=kwargs.get("autoscale", False),
                              prune_strays=kwargs.get("prune", True),
                              policy=kwargs.get("policy", OperatorPolicy()))

    return asyncio.run(go())
