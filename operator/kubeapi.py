"""A small async Kubernetes API client on httpx: server-side apply, get, list, delete.

Credentials come from kopf's own login helpers (service account in-cluster, kubeconfig
outside), the same ones the operator's kopf side uses. In-cluster, the token file is
re-read per request because the kubelet rotates projected tokens.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import tempfile
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import httpx

from tandem.operator import names

SA_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"

# Plural names of the kinds the operator touches; the set is fixed, so no discovery round-trips.
PLURALS = {
    "ConfigMap": "configmaps",
    "Deployment": "deployments",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers",
    "HTTPRoute": "httproutes",
    "InferencePool": "inferencepools",
    "NetworkPolicy": "networkpolicies",
    "Pod": "pods",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "Role": "roles",
    "RoleScaler": "rolescalers",
    "RoleBinding": "rolebindings",
    "Secret": "secrets",
    "Service": "services",
    "ServiceAccount": "serviceaccounts",
    names.KIND: names.PLURAL,
}


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str):
        self.status, self.reason, self.message = status, reason, message
        super().__init__(f"{status} {reason}: {message}")

    @property
    def transient(self) -> bool:
        """Worth retrying as is: conflicts, throttling, server trouble, timeouts."""
        return self.status in (408, 409, 429) or self.status >= 500


@dataclass(frozen=True)
class Credentials:
    server: str
    token: str | None = None
    token_file: str | None = None
    ca_path: str | None = None
    ca_data: str | None = None  # base64 PEM, as in kubeconfig
    cert_path: str | None = None
    key_path: str | None = None
    insecure: bool = False


class _BearerAuth(httpx.Auth):
    def __init__(self, creds: Credentials):
        self._creds = creds

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        token = self._creds.token
        if self._creds.token_file and os.path.exists(self._creds.token_file):
            with open(self._creds.token_file, encoding="utf-8") as f:
                token = f.read().strip()
        if token:
            request.headers["Authorization"] = f"Bearer {token}"
        yield request


def _ssl_context(creds: Credentials) -> ssl.SSLContext | bool:
    if not creds.server.startswith("https"):
        return True
    if creds.insecure:
        return False
    ctx = ssl.create_default_context(
        cafile=creds.ca_path,
        cadata=base64.b64decode(creds.ca_data).decode() if creds.ca_data else None,
    )
    if creds.cert_path and creds.key_path:
        ctx.load_cert_chain(creds.cert_path, creds.key_path)
    return ctx


def credentials_from_kopf(info: Any) -> Credentials:
    """Map a kopf.ConnectionInfo onto Credentials; inline cert/key data goes to private temp files."""

    def to_file(data: str | bytes | None, suffix: str) -> str | None:
        if not data:
            return None
        raw = base64.b64decode(data)
        fd, path = tempfile.mkstemp(suffix=suffix)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        return path

    ca_data = info.ca_data.decode() if isinstance(info.ca_data, bytes) else info.ca_data
    return Credentials(
        server=str(info.server).rstrip("/"),
        token=info.token,
        token_file=SA_TOKEN if info.token and os.path.exists(SA_TOKEN) else None,
        ca_path=str(info.ca_path) if info.ca_path else None,
        ca_data=ca_data,
        cert_path=(str(info.certificate_path) if info.certificate_path
                   else to_file(info.certificate_data, ".crt")),
        key_path=(str(info.private_key_path) if info.private_key_path
                  else to_file(info.private_key_data, ".key")),
        insecure=bool(info.insecure),
    )


def resource_path(api_version: str, kind: str, namespace: str, name: str | None = None,
                  subresource: str | None = None) -> str:
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{base}/namespaces/{namespace}/{PLURALS[kind]}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


class KubeApi:
    def __init__(self, client: httpx.AsyncClient, field_manager: str = names.FIELD_MANAGER):
        self._client = client
        self.field_manager = field_manager

    @classmethod
    def connect(cls, creds: Credentials, timeout_s: float = 15.0) -> KubeApi:
        # trust_env=False: like kopf's own client, ignore HTTP(S)_PROXY for the API server.
        client = httpx.AsyncClient(base_url=creds.server, auth=_BearerAuth(creds), verify=_ssl_context(creds),
                                   timeout=timeout_s, trust_env=False)
        return cls(client)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        if self._client.is_closed:  # the operator is shutting down under a still-running handler
            raise ApiError(503, "ClientClosed", "the operator is stopping")
        try:
            response = await self._client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ApiError(503, type(exc).__name__, str(exc) or "connection failed") from exc
        if response.status_code >= 400:
            try:
                body = response.json()
            except ValueError:
                body = {}
            raise ApiError(response.status_code, str(body.get("reason") or response.reason_phrase),
                           str(body.get("message") or response.text[:300]))
        return response

    async def apply(self, manifest: dict[str, Any], force: bool = True) -> dict[str, Any]:
        """Server-side apply: the API server merges our fields and creates the object if absent."""
        meta = manifest["metadata"]
        path = resource_path(manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"])
        response = await self._send(
            "PATCH", path,
            params={"fieldManager": self.field_manager, "force": "true" if force else "false"},
            content=json.dumps(manifest).encode(),  # JSON is YAML, which apply-patch+yaml accepts
            headers={"Content-Type": "application/apply-patch+yaml"},
        )
        return response.json()

    async def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """A plain create (POST): 409 AlreadyExists when the object exists, which apply never says.
        For objects that must be written once and never overwritten (security/pd_secret.py)."""
        meta = manifest["metadata"]
        path = resource_path(manifest["apiVersion"], manifest["kind"], meta["namespace"])
        response = await self._send("POST", path, params={"fieldManager": self.field_manager},
                                    content=json.dumps(manifest).encode(),
                                    headers={"Content-Type": "application/json"})
        return response.json()

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            response = await self._send("GET", resource_path(api_version, kind, namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise
        return response.json()

    async def list(self, api_version: str, kind: str, namespace: str,
                   labels: dict[str, str]) -> list[dict[str, Any]]:
        selector = names.selector_string(labels)
        response = await self._send("GET", resource_path(api_version, kind, namespace),
                                    params={"labelSelector": selector})
        items = response.json().get("items") or []
        # Filter here as well: selectors are the server's job, but a wrong match would be acted upon.
        return [i for i in items if labels.items() <= ((i.get("metadata") or {}).get("labels") or {}).items()]

    async def merge_patch(self, api_version: str, kind: str, namespace: str, name: str,
                          body: dict[str, Any], subresource: str | None = None) -> dict[str, Any]:
        """A JSON merge patch of a few fields we do not own through apply (an old generation's
        replicas, a pod annotation, a status): it leaves the applied field set untouched."""
        response = await self._send(
            "PATCH", resource_path(api_version, kind, namespace, name, subresource),
            params={"fieldManager": self.field_manager}, content=json.dumps(body).encode(),
            headers={"Content-Type": "application/merge-patch+json"},
        )
        return response.json()

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        try:
            await self._send("DELETE", resource_path(api_version, kind, namespace, name),
                             json={"propagationPolicy": "Background"})
        except ApiError as exc:
            if exc.status != 404:
                raise
