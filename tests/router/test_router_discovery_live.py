"""Kubernetes discovery's real path: `PodDiscovery.run()` lists and watches pods with the `kubernetes`
client (a thread per role) against kmock, an HTTP Kubernetes API emulator (tests/operator/operator_kmock.py,
which adds equality label selectors to it). In process against a WorkerSet, then as the operator runs it:
`tandem router --selector SEL --namespace NS` in front of a fake worker (bench/fake_worker.py).

kmock is an emulator: pods are created with their status (nothing schedules them), and its watch
replays the current objects first whatever the resource version; discovery takes both in stride."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tandem.worker_contract import BOOTSTRAP_PORT_NAME, GENERATION_LABEL, HTTP_PORT_NAME

pytest.importorskip("kmock", reason="pip install kmock (operator-test)")
pytest.importorskip("kubernetes", reason="pip install kubernetes (the router's discovery)")
from operator_kmock import KmockCluster, free_port, wait_for  # noqa: E402
from waits import async_wait_until

from tandem.router.discovery import PodDiscovery  # noqa: E402
from tandem.router.workers import COLOCATED, DECODE, PREFILL, WorkerSet  # noqa: E402

# kmock reads its bundled resource list with a deprecated importlib API; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")
REPO = Path(__file__).resolve().parents[2]
NS, PODS = "serving", "v1/pods"
READY = [{"type": "Ready", "status": "True"}]


def pod(name: str, labels: dict[str, str], ip: str = "10.0.0.1", http: int = 9000, bootstrap: int | None = None,
        ready: bool = True, namespace: str = NS, finalizers: tuple[str, ...] = ()) -> dict[str, Any]:
    ports = [{"name": HTTP_PORT_NAME, "containerPort": http}]
    ports += [{"name": BOOTSTRAP_PORT_NAME, "containerPort": bootstrap}] if bootstrap else []
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": labels, "finalizers": list(finalizers)},
            "spec": {"containers": [{"name": "worker", "image": "tandem", "ports": ports}]},
            "status": {"phase": "Running", "podIP": ip, "conditions": READY if ready else []}}


class Api:
    """The few pod calls the tests make, as plain HTTP to the emulator."""

    def __init__(self, http: httpx.Client) -> None:
        self.http = http

    def _pods(self, namespace: str, name: str = "") -> str:
        return f"/api/v1/namespaces/{namespace}/pods" + (f"/{name}" if name else "")

    def create(self, body: dict[str, Any]) -> None:
        self.http.post(self._pods(body["metadata"]["namespace"]), json=body).raise_for_status()

    def patch(self, name: str, body: dict[str, Any]) -> None:
        self.http.patch(self._pods(NS, name), json=body,
                        headers={"Content-Type": "application/merge-patch+json"}).raise_for_status()

    def delete(self, name: str) -> None:
        self.http.delete(self._pods(NS, name)).raise_for_status()

    def names(self) -> set[str]:
        return {p["metadata"]["name"] for p in self.http.get(self._pods(NS)).json()["items"]}


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KmockCluster]:
    cluster = KmockCluster().start()
    monkeypatch.setenv("KUBECONFIG", str(cluster.write_kubeconfig(tmp_path / "kubeconfig", NS)))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # never the cluster a test machine runs in
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def api(cluster: KmockCluster) -> Iterator[Api]:
    with httpx.Client(base_url=f"http://127.0.0.1:{cluster.port}", timeout=10) as http:
        yield Api(http)


def watch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("pod-watch-")]


async def until(what: str, probe: Callable[[], object], timeout: float = 10.0) -> None:
    await async_wait_until(probe, timeout, what)


async def discovering(cluster: KmockCluster, api: Api, selectors: dict[str, str], test: Callable[..., Any]) -> None:
    """Run `test(api, workers, removed)` while discovery runs; then check its threads stop."""
    ws, removed, before = WorkerSet(), [], set(watch_threads())
    task = asyncio.create_task(PodDiscovery(ws, NS, selectors, on_remove=removed.append).run())
    try:
        await test(api, ws, removed)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        cluster.expire_watches(PODS, NS)  # one more event: a cancelled discovery's threads see it and exit
    await until("the watch threads to exit", lambda: not set(watch_threads()) - before)


def test_colocated_pods_join_and_leave_through_list_and_watch(cluster: KmockCluster, api: Api) -> None:
    sel = {"app": "m", "tier": "worker"}
    api.create(pod("before", sel, ip="10.0.0.1"))  # exists before the router: found by the first list
    api.create(pod("unrelated", {"app": "other"}, ip="10.0.0.9"))
    api.create(pod("elsewhere", sel, ip="10.0.0.8", namespace="other"))

    async def test(api: Api, ws: WorkerSet, removed: list[str]) -> None:
        await until("the listed pod", lambda: "http://10.0.0.1:9000" in ws.workers)
        assert ws.workers["http://10.0.0.1:9000"].role == COLOCATED
        api.create(pod("starting", sel, ip="10.0.0.2", ready=False))
        api.create(pod("up", sel, ip="10.0.0.3", finalizers=("test/hold",)))
        await until("a watched pod", lambda: "http://10.0.0.3:9000" in ws.workers)
        # Events of one role arrive in order: "starting" was seen before "up", and is not Ready.
        assert set(ws.workers) == {"http://10.0.0.1:9000", "http://10.0.0.3:9000"}
        api.patch("starting", {"status": {"conditions": READY}})
        await until("the pod that became Ready", lambda: "http://10.0.0.2:9000" in ws.workers)
        api.patch("starting", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}})
        await until("the NotReady pod to leave", lambda: "http://10.0.0.2:9000" not in ws.workers)
        # Deleting a pod with a finalizer marks it (deletionTimestamp) and keeps it in the API while
        # it terminates, as a pod's grace period does: it leaves the set at once all the same.
        api.delete("up")
        await until("the terminating pod to leave", lambda: "http://10.0.0.3:9000" not in ws.workers)
        assert "up" in api.names() and removed == ["http://10.0.0.2:9000", "http://10.0.0.3:9000"]
        api.delete("starting")
        api.patch("up", {"metadata": {"finalizers": []}})  # now DELETED: nothing left to remove
        api.create(pod("late", sel, ip="10.0.0.4"))
        await until("a pod after the deletions", lambda: "http://10.0.0.4:9000" in ws.workers)
        assert set(ws.workers) == {"http://10.0.0.1:9000", "http://10.0.0.4:9000"}
        assert len(removed) == 2

    asyncio.run(discovering(cluster, api, {COLOCATED: "app=m,tier=worker"}, test))


def test_a_relist_after_an_expired_watch_drops_pods_deleted_unseen(cluster: KmockCluster, api: Api) -> None:
    """A deletion that happened while no watch was open sends no event: only the relist after the
    watch ends (410 Gone here) shows it, and the pod must leave then."""
    sel = {"app": "m"}

    async def test(api: Api, ws: WorkerSet, removed: list[str]) -> None:
        api.create(pod("kept", sel, ip="10.0.0.1"))
        api.create(pod("lost", sel, ip="10.0.0.2"))
        await until("both pods", lambda: len(ws.workers) == 2)
        cluster.lose(PODS, NS, "lost")  # gone from the API, and no DELETED event
        await asyncio.sleep(0.3)  # sleep-ok: no event may remove the lost pod: a quiet window
        assert len(ws.workers) == 2
        cluster.expire_watches(PODS, NS)
        await until("the relist to drop the lost pod", lambda: list(ws.workers) == ["http://10.0.0.1:9000"])
        assert removed == ["http://10.0.0.2:9000"]
        api.create(pod("after", sel, ip="10.0.0.3"))  # and the new watch is live
        await until("a pod on the new watch", lambda: "http://10.0.0.3:9000" in ws.workers)

    asyncio.run(discovering(cluster, api, {COLOCATED: "app=m"}, test))


def test_pd_roles_by_selector_with_bootstrap_port_and_generation(cluster: KmockCluster, api: Api) -> None:
    prefill, decode = {"app": "m", "role": "prefill"}, {"app": "m", "role": "decode"}

    async def test(api: Api, ws: WorkerSet, removed: list[str]) -> None:
        api.create(pod("p0", {**prefill, GENERATION_LABEL: "g1"}, ip="10.0.1.1", bootstrap=8998))
        api.create(pod("p-no-bootstrap", prefill, ip="10.0.1.2"))  # skipped: PD cannot use it
        api.create(pod("d0", {**decode, GENERATION_LABEL: "g1"}, ip="10.0.2.1", http=9100))
        api.create(pod("p1", prefill, ip="10.0.1.3", bootstrap=7000))
        await until("both roles", lambda: {"http://10.0.1.3:9000", "http://10.0.2.1:9100"} <= set(ws.workers))
        assert set(ws.workers) == {"http://10.0.1.1:9000", "http://10.0.1.3:9000", "http://10.0.2.1:9100"}
        p0, d0 = ws.workers["http://10.0.1.1:9000"], ws.workers["http://10.0.2.1:9100"]
        assert (p0.role, p0.bootstrap_port, p0.generation) == (PREFILL, 8998, "g1")
        assert (d0.role, d0.bootstrap_port, d0.generation) == (DECODE, None, "g1")
        assert ws.workers["http://10.0.1.3:9000"].bootstrap_port == 7000
        api.patch("d0", {"metadata": {"labels": {GENERATION_LABEL: "g2"}}})
        await until("the new generation", lambda: ws.workers["http://10.0.2.1:9100"].generation == "g2")
        api.delete("p0")
        await until("the deleted prefill pod to leave", lambda: "http://10.0.1.1:9000" not in ws.workers)
        assert removed == ["http://10.0.1.1:9000"]

    asyncio.run(discovering(cluster, api, {PREFILL: "app=m,role=prefill", DECODE: "app=m,role==decode"}, test))


def spawn(argv: list[str], log: Path, cwd: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, *argv], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)


def test_router_process_follows_pods_as_the_operator_starts_it(api: Api, tmp_path: Path) -> None:
    worker_port, router_port = free_port(), free_port()
    log = tmp_path / "processes.log"
    procs = [spawn([str(REPO / "bench" / "fake_worker.py"), "--port", str(worker_port), "--ttft", "0", "--itl", "0",
                    "--tokens", "4"], log, tmp_path),
             spawn(["-m", "tandem.cli", "router", "--host", "127.0.0.1", "--port", str(router_port),
                    "--admin-port", str(free_port()),
                    "--selector", "app=fake", "--namespace", NS, "--health-interval", "0.5"], log, tmp_path)]
    router = httpx.Client(base_url=f"http://127.0.0.1:{router_port}", timeout=10)

    def workers() -> list[str] | None:
        assert all(p.poll() is None for p in procs), log.read_text()[-4000:]
        with contextlib.suppress(httpx.HTTPError):
            return [w["url"] for w in router.get("/workers").json()["workers"]]
        return None

    try:
        wait_for("the router", lambda: workers() is not None, timeout=20)
        api.create(pod("fake-0", {"app": "fake"}, ip="127.0.0.1", http=worker_port, finalizers=("test/hold",)))
        wait_for("the pod's worker", lambda: workers() == [f"http://127.0.0.1:{worker_port}"], timeout=10)
        reply = router.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 4}})
        assert reply.status_code == 200, reply.text
        assert reply.json()["text"] == "xxxx"
        api.delete("fake-0")  # terminating: out of the router before it is gone from the API
        wait_for("the terminating pod to leave", lambda: workers() == [], timeout=10)
    finally:
        router.close()
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
