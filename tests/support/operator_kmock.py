"""A kmock-based Kubernetes API for end-to-end operator tests, served from a background thread.

kmock's KubernetesEmulator stores objects and serves list/watch/get/create/patch/delete.
This subclass adds what kopf, kubectl and our operator rely on and kmock leaves out:

| gap in kmock                                      | what the subclass does                        |
|---------------------------------------------------|-----------------------------------------------|
| no metadata.uid / resourceVersion / generation    | stamps them on create and patch               |
| list responses without kind / apiVersion          | adds them (kubectl needs them)                 |
| core discovery says groupVersion "/v1"            | answers "v1", so kubectl finds core resources  |
| server-side apply on a missing object is a 404    | treats it as a create, like the API server     |
| no garbage collection                             | deletes objects whose controller owner is gone |
| request matching scans the whole request history  | keeps only the last few requests               |
| no label selectors                                | equality ones (k=v, k==v, k!=v) on list, watch |

It still does no set-based selectors, strategic merge, schema validation or 409s; tests
must not rely on those. Besides InferenceServices it serves RoleScalers and kopf's peering
resources (kopf.dev/v1), so the operator runs with --peering as the chart runs it, and GIE's
InferencePools and Gateway API's HTTPRoutes, either of which `withhold` turns into a missing CRD.
The polling and /metrics helpers at the end are shared by the end-to-end tests.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import json
import re
import threading
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp.web
import attrs
import kmock
from kmock._internal import enums
from kmock._internal.k8s import KubernetesResourceNotFoundError
from operator_support import merge_patch
from prometheus_client.parser import text_string_to_metric_families
from waits import wait_until

from tandem.local.plan import free_port  # noqa: F401  (the tests import it from here)

T = TypeVar("T")
CR_RESOURCE = "tandem.dev/v1alpha1/inferenceservices"
ROLESCALER_RESOURCE = "tandem.dev/v1alpha1/rolescalers"
# kopf's peering resources (kopf.dev/v1), served like any CR: kopf only lists, watches and
# merge-patches them, which kmock does.
CLUSTER_PEERING_RESOURCE = "kopf.dev/v1/clusterkopfpeerings"
PEERING_RESOURCE = "kopf.dev/v1/kopfpeerings"
# spec.gateway's children, from CRDs a real cluster may lack: `withhold` makes one answer 404.
INFERENCE_POOL_RESOURCE = "inference.networking.k8s.io/v1/inferencepools"
HTTP_ROUTE_RESOURCE = "gateway.networking.k8s.io/v1/httproutes"


def selected(selector: str | None, obj: dict[str, Any]) -> bool:
    """Whether an object's labels match an equality-based label selector (what our code sends)."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        match = re.fullmatch(r"([^!=]+)(!=|==|=)(.*)", term)
        assert match is not None, f"unsupported label selector term {term!r}"
        key, op, value = match.groups()
        if (labels.get(key) == value) != (op != "!="):
            return False
    return True


@attrs.define(kw_only=True)
class StampingEmulator(kmock.KubernetesEmulator):
    _rv: int = 0
    # Resources served as if their CRD were not installed: every request gets a 404.
    withheld: set[str] = attrs.field(factory=set)

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _live(self, key: tuple[Any, Any, Any]) -> dict[str, Any] | None:
        if key in self.objects and not self.objects[key].deleted:
            return self.objects[key].raw
        return None

    async def _handle(self, request: kmock.Request) -> Any:
        # kmock matches each request by scanning every request it has ever served, which turns
        # quadratic under an operator's steady traffic; only the current request matters here.
        del self._requests[:-8]
        if request.resource is not None and str(request.resource) in self.withheld:
            raise KubernetesResourceNotFoundError()
        data = request.data
        if request.resource is not None and isinstance(data, dict):
            key = (request.resource, request.namespace, request.name)
            content_type = request.headers.get("Content-Type", "")
            upsert = request.action == enums.action.UPDATE and "apply-patch" in content_type \
                and not self._live(key)
            meta = data.setdefault("metadata", {})
            if request.action == enums.action.CREATE or upsert:
                meta.update(uid=str(uuid.uuid4()), generation=1, resourceVersion=self._next_rv(),
                            creationTimestamp=datetime.datetime.now(datetime.UTC)
                            .strftime("%Y-%m-%dT%H:%M:%SZ"))
            elif request.action == enums.action.UPDATE:
                old = self._live(key) or {}
                old_meta = old.get("metadata") or {}
                bumped = request.subresource is None and "spec" in data and \
                    merge_patch(old.get("spec"), data["spec"]) != old.get("spec")
                meta.pop("uid", None)  # identity never changes through a patch
                meta["resourceVersion"] = self._next_rv()
                meta["generation"] = int(old_meta.get("generation") or 1) + (1 if bumped else 0)
            if upsert:
                return await self._create_applied(request, key)
        response = await super()._handle(request)
        if request.action in (enums.action.DELETE, enums.action.UPDATE) and request.resource is not None:
            await self._collect_garbage()  # a delete, or a patch that removed the last finalizer
        return response

    async def _create_applied(self, request: kmock.Request, key: tuple[Any, Any, Any]) -> Any:
        """Server-side apply of an absent object creates it, as the API server does."""
        async with self._lock:
            self.objects[key] = request.data
            raw = self.objects[key].raw
            await self._buses[request.resource].put({"type": "ADDED", "object": raw})
        return aiohttp.web.json_response(raw, status=201)

    async def _serve_version(self, request: kmock.Request) -> Any:
        payload = await super()._serve_version(request)
        payload["groupVersion"] = payload["groupVersion"].lstrip("/")  # the core group is "v1", not "/v1"
        return payload

    async def _serve_list(self, request: kmock.Request) -> Any:
        payload = await super()._serve_list(request)
        info = self.resources[request.resource]
        group = request.resource.group
        payload["kind"] = f"{info.kind}List"
        payload["apiVersion"] = f"{group}/{request.resource.version}" if group else request.resource.version
        payload["items"] = [i for i in payload["items"] if selected(request.params.get("labelSelector"), i)]
        return payload

    async def _serve_watch(self, request: kmock.Request) -> Any:
        selector = request.params.get("labelSelector")
        async for event in super()._serve_watch(request):
            if not isinstance(event, dict) or event.get("type") == "ERROR" or selected(selector, event["object"]):
                yield event

    async def _collect_garbage(self) -> None:
        """Delete every object whose controller owner no longer exists, until nothing changes."""
        while True:
            async with self._lock:
                live = [obj for obj in self.objects.values() if not obj.deleted]
                live_uids = {obj.raw["metadata"].get("uid") for obj in live}
                orphans = [
                    (key, obj) for key, obj in self.objects.items()
                    if not obj.deleted and any(
                        ref.get("controller") and ref.get("uid") not in live_uids
                        for ref in obj.raw["metadata"].get("ownerReferences") or [])
                ]
                for (resource, _, _), obj in orphans:
                    raw = obj.raw
                    obj.delete()
                    await self._buses[resource].put({"type": "DELETED", "object": raw})
            if not orphans:
                return


class KmockCluster:
    """Runs the emulator on 127.0.0.1 in its own thread and event loop."""

    def __init__(self) -> None:
        self.port = 0
        self.emulator: StampingEmulator | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        async with StampingEmulator() as emulator, kmock.Server(emulator) as server:
            emulator.resources.load_bundled()
            emulator.resources[CR_RESOURCE] = kmock.ResourceInfo(
                kind="InferenceService", singular="inferenceservice", namespaced=True,
                shortnames={"tisvc"}, categories={"tandem"}, subresources={"status", "scale"},
                verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
            )
            emulator.resources[ROLESCALER_RESOURCE] = kmock.ResourceInfo(
                kind="RoleScaler", singular="rolescaler", namespaced=True, categories={"tandem"},
                subresources={"status", "scale"}, verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
            )
            for resource, kind, namespaced in ((CLUSTER_PEERING_RESOURCE, "ClusterKopfPeering", False),
                                               (PEERING_RESOURCE, "KopfPeering", True),
                                               (INFERENCE_POOL_RESOURCE, "InferencePool", True),
                                               (HTTP_ROUTE_RESOURCE, "HTTPRoute", True)):
                emulator.resources[resource] = kmock.ResourceInfo(
                    kind=kind, singular=kind.lower(), namespaced=namespaced,
                    verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
                )
            self.emulator, self.port = emulator, server.port
            self._ready.set()
            await self._stop.wait()

    def start(self) -> KmockCluster:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("kmock did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def write_kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}],
            "users": [{"name": "kmock", "user": {"token": "kmock"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock",
                                                       "namespace": namespace}}],
        }
        path.write_text(json.dumps(config))
        return path

    def _call(self, fn: Callable[[StampingEmulator], Any]) -> Any:
        """Run a coroutine function on the emulator's own loop and return its result."""
        assert self.emulator is not None and self._loop is not None
        return asyncio.run_coroutine_threadsafe(fn(self.emulator), self._loop).result(10)

    def expire_watches(self, resource: str, namespace: str) -> None:
        """Send every open watch of a resource in a namespace a 410 Gone ERROR event, as the API
        server does when a watch's resource version is too old: a client must list again."""
        gone = {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410,
                                            "reason": "Expired", "message": "too old resource version",
                                            "metadata": {"namespace": namespace}}}  # kmock routes by namespace

        async def put(emulator: StampingEmulator) -> None:
            for res, bus in list(emulator._buses.items()):
                if str(res) == str(kmock.resource(resource)):
                    await bus.put(gone)

        self._call(put)

    def withhold(self, resource: str, withheld: bool = True) -> None:
        """Serve `resource` as a cluster without its CRD does (404 to everything), or again as usual."""
        async def change(emulator: StampingEmulator) -> None:
            (emulator.withheld.add if withheld else emulator.withheld.discard)(str(kmock.resource(resource)))

        self._call(change)

    def lose(self, resource: str, namespace: str, name: str) -> None:
        """Delete an object without a DELETED event: what a client misses while its watch is down."""
        async def delete(emulator: StampingEmulator) -> None:
            async with emulator._lock:
                for (res, ns, n), obj in emulator.objects.items():
                    if str(res) == str(kmock.resource(resource)) and (ns, n) == (namespace, name):
                        obj.delete()

        self._call(delete)

    def live(self, resource: str, namespace: str | None = None) -> list[dict[str, Any]]:
        """Snapshot of live objects of one resource, read on the emulator's own loop."""
        assert self.emulator is not None and self._loop is not None
        emulator = self.emulator

        async def snapshot() -> list[dict[str, Any]]:
            async with emulator._lock:
                return [copy.deepcopy(obj.raw) for (res, ns, _), obj in emulator.objects.items()
                        if not obj.deleted and str(res) == str(kmock.resource(resource))
                        and (namespace is None or ns == namespace)]

        return asyncio.run_coroutine_threadsafe(snapshot(), self._loop).result(10)


def scrape(port: int) -> dict[str, float]:
    """Every sample on an operator's /metrics, keyed like `name{label="value",...}`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {s.name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items())) + "}": s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def reconciles(samples: dict[str, float]) -> float:
    return sum(v for k, v in samples.items() if k.startswith("tandem_operator_reconcile_total{"))


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 30.0) -> T:
    return wait_until(probe, timeout, what, interval=0.25)


def condition(cr: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for cond in ((cr or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == kind:
            return cond
    return {}
