"""Kubernetes discovery: the worker set follows the pods that match the role selectors.

    tandem router --prefill-selector SEL --decode-selector SEL --namespace NS   (PD, as the operator runs it)
    tandem router --selector SEL --namespace NS                                (colocated)

A pod is a worker while it is Ready, has an IP, and has no deletionTimestamp: a pod marked
for deletion leaves the set at once, before its endpoints do, so it gets no new request
while it drains. A prefill pod's bootstrap port is its container port named `bootstrap`;
its model generation (the label the operator sets) pairs it only with decode pods of the
same generation.

`apply(event, pod)` and `sync(pods)` (a full list) are pure bookkeeping over plain dicts (the
API's JSON), so tests replay recorded pod events through them; `run()` lists and watches with the
`kubernetes` client, and relists whenever a watch ends.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any

from tandem.router.workers import COLOCATED, DECODE, PREFILL, Worker, WorkerSet
from tandem.worker_contract import BOOTSTRAP_PORT_NAME, GENERATION_LABEL, HTTP_PORT, HTTP_PORT_NAME

log = logging.getLogger(__name__)
LISTED = "LISTED"  # not a watch event: a full list of one role's pods, from a (re)list


def _ready(pod: dict[str, Any]) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def _uid(pod: dict[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return str(meta.get("uid") or meta.get("name", ""))


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
        self.by_pod: dict[str, tuple[str, str]] = {}  # pod uid -> (role, worker url)

    def apply(self, event: str, pod: dict[str, Any], role: str) -> None:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        uid = _uid(pod)
        ip = status.get("podIP")
        live = event != "DELETED" and not meta.get("deletionTimestamp") and _ready(pod) and bool(ip)
        old = self.by_pod[uid][1] if uid in self.by_pod else None
        if not live:
            if old is not None:
                del self.by_pod[uid]
                self.workers.remove(old)
                self.on_remove(old)
                log.info("pod %s left the %s pool (%s)", meta.get("name", uid), role, event)
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
        self.by_pod[uid] = (role, url)

    def sync(self, pods: list[dict[str, Any]], role: str) -> None:
        """A (re)list is the whole truth for its role: a pod deleted while no watch was open
        (the API server restarted, the watch expired) sent no DELETED event to us, and without
        this it would stay a worker forever."""
        for pod in pods:
            self.apply("ADDED", pod, role)
        listed = {_uid(pod) for pod in pods}
        for uid in [u for u, (r, _) in self.by_pod.items() if r == role and u not in listed]:
            self.apply("DELETED", {"metadata": {"uid": uid}}, role)

    async def run(self) -> None:
        """List, then watch each role's pods (the client is synchronous: one thread per role)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[str, Any, str]] = asyncio.Queue()
        stop = threading.Event()
        for role, selector in self.selectors.items():
            threading.Thread(target=self._watch, args=(role, selector, loop, events, stop), daemon=True,
                             name=f"pod-watch-{role}").start()
        try:
            while True:
                event, payload, role = await events.get()
                if event == LISTED:
                    self.sync(payload, role)
                else:
                    self.apply(event, payload, role)
        finally:
            # A blocking read cannot be interrupted: a thread sees this at its watch's next event
            # or end (timeout_seconds) and exits instead of feeding a loop that may be gone.
            stop.set()

    def _watch(self, role: str, selector: str, loop: asyncio.AbstractEventLoop, events: asyncio.Queue,
               stop: threading.Event) -> None:
        from kubernetes import client, config, watch

        def put(event: str, payload: Any) -> None:
            if not stop.is_set():
                loop.call_soon_threadsafe(events.put_nowait, (event, payload, role))

        while not stop.is_set():
            try:
                # Inside the loop: a thread that died on a missing config would end discovery silently.
                try:
                    config.load_incluster_config()
                except config.ConfigException:
                    # $KUBECONFIG read now: the client's own default is read once, at its import.
                    config.load_kube_config(os.environ.get("KUBECONFIG"))
                with client.ApiClient() as api_client:  # closes its connection pool, whatever ends the watch
                    api = client.CoreV1Api(api_client)
                    pods = api.list_namespaced_pod(self.namespace, label_selector=selector)
                    put(LISTED, [api_client.sanitize_for_serialization(item) for item in pods.items])
                    stream = watch.Watch().stream(api.list_namespaced_pod, self.namespace, label_selector=selector,
                                                  resource_version=pods.metadata.resource_version, timeout_seconds=300)
                    for ev in stream:
                        if stop.is_set():
                            return
                        put(ev["type"], api_client.sanitize_for_serialization(ev["object"]))
                # The server ended the watch (timeout_seconds): list and watch again.
            except Exception as exc:  # the API server restarts, the watch expires (410): list and watch again
                if stop.is_set():
                    return
                expired = isinstance(exc, client.ApiException) and exc.status == 410
                # 410 Gone is routine (the resource version is too old): relist at once, as the client documents.
                log.log(logging.INFO if expired else logging.WARNING, "pod watch for %s ended (%s); restarting",
                        role, exc)
                if not expired:
                    stop.wait(2.0)


def role_selectors(selector: str | None, prefill: str | None, decode: str | None) -> dict[str, str]:
    sel = {COLOCATED: selector, PREFILL: prefill, DECODE: decode}
    return {role: s for role, s in sel.items() if s}
