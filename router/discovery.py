"""Kubernetes discovery: the worker set follows the pods that match the role selectors.

    tandem router --prefill-selector SEL --decode-selector SEL --namespace NS   (PD, as the operator runs it)
    tandem router --selector SEL --namespace NS                                (colocated)

A pod is a worker while it is Ready, has an IP, and has no deletionTimestamp: a pod marked
for deletion leaves the set at once, before its endpoints do, so it gets no new request
while it drains. A prefill pod's bootstrap port is its container port named `bootstrap`;
its model generation (the label the operator sets) pairs it only with decode pods of the
same generation.

`apply(event, pod)` is pure bookkeeping over plain dicts (the API's JSON), so tests replay
recorded pod events through it; `run()` lists and watches with the `kubernetes` client.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from tandem.router.workers import COLOCATED, DECODE, PREFILL, Worker, WorkerSet
from tandem.worker_contract import BOOTSTRAP_PORT_NAME, GENERATION_LABEL, HTTP_PORT, HTTP_PORT_NAME

log = logging.getLogger(__name__)


def _ready(pod: dict[str, Any]) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def _port(pod: dict[str, Any], name: str) -> int | None:
    for c in (pod.get("spec") or {}).get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == name:
                return int(p["containerPort"])
    return None


class PodDiscovery:
    def __init__(self, workers: WorkerSet, namespace: str, selectors: dict[str, str],
                 on_remove: Any = lambda url: None) -> None:
        self.workers, self.namespace, self.selectors = workers, namespace, selectors
        self.on_remove = on_remove
        self.by_pod: dict[str, str] = {}  # pod uid -> worker url

    def apply(self, event: str, pod: dict[str, Any], role: str) -> None:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        uid = meta.get("uid") or meta.get("name", "")
        ip = status.get("podIP")
        live = event != "DELETED" and not meta.get("deletionTimestamp") and _ready(pod) and bool(ip)
        old = self.by_pod.get(uid)
        if not live:
            if old is not None:
                del self.by_pod[uid]
                self.workers.remove(old)
                self.on_remove(old)
                log.info("pod %s left the %s pool (%s)", meta.get("name"), role, event)
            return
        url = f"http://{ip}:{_port(pod, HTTP_PORT_NAME) or HTTP_PORT}"
        if old is not None and old != url:
            self.workers.remove(old)
        bootstrap = _port(pod, BOOTSTRAP_PORT_NAME) if role == PREFILL else None
        if role == PREFILL and bootstrap is None:
            log.warning("prefill pod %s has no port named %r: skipped", meta.get("name"), BOOTSTRAP_PORT_NAME)
            return
        generation = (meta.get("labels") or {}).get(GENERATION_LABEL, "")
        self.workers.add(Worker(url, role, bootstrap, generation))
        if old is None:
            log.info("pod %s joined the %s pool at %s", meta.get("name"), role, url)
        self.by_pod[uid] = url

    async def run(self) -> None:
        """List, then watch each role's pods (the client is synchronous: one thread per role)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        for role, selector in self.selectors.items():
            threading.Thread(target=self._watch, args=(role, selector, loop, events), daemon=True).start()
        while True:
            event, pod, role = await events.get()
            self.apply(event, pod, role)

    def _watch(self, role: str, selector: str, loop: asyncio.AbstractEventLoop, events: asyncio.Queue) -> None:
        from kubernetes import client, config, watch

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        api = client.CoreV1Api()
        while True:
            try:
                pods = api.list_namespaced_pod(self.namespace, label_selector=selector)
                for item in pods.items:
                    pod = api.api_client.sanitize_for_serialization(item)
                    loop.call_soon_threadsafe(events.put_nowait, ("ADDED", pod, role))
                stream = watch.Watch().stream(api.list_namespaced_pod, self.namespace, label_selector=selector,
                                              resource_version=pods.metadata.resource_version, timeout_seconds=300)
                for ev in stream:
                    pod = api.api_client.sanitize_for_serialization(ev["object"])
                    loop.call_soon_threadsafe(events.put_nowait, (ev["type"], pod, role))
            except Exception as exc:  # the API server restarts, a watch expires: list and watch again
                log.warning("pod watch for %s ended (%s); restarting", role, exc)
                threading.Event().wait(2.0)


def role_selectors(selector: str | None, prefill: str | None, decode: str | None) -> dict[str, str]:
    sel = {COLOCATED: selector, PREFILL: prefill, DECODE: decode}
    return {role: s for role, s in sel.items() if s}
