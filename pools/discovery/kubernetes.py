"""Engines in Kubernetes: the ready endpoints of the engine groups' headless Services.

Two ways to read them (`engines.kubernetes.discovery`):

- `api`: EndpointSlices (`discovery.k8s.io/v1`) listed through the API server with the pod's
  service-account token; the Role needs only get/list/watch on `endpointslices`. Instance ids
  are pod names (a StatefulSet's `<group>-0`, `-1`, ...), so an engine that restarts keeps
  its id. An endpoint counts when `conditions.ready` is true or unset (as the API says a
  consumer should read unset) and it is not `terminating`; a pod being deleted turns
  terminating first, so the router drains it while it still finishes its work.
- `dns`: the headless Service's A records (`<service>.<namespace>.svc.<cluster domain>`); no
  RBAC, but only ready pods are listed and ids follow pod IPs (`<service>-10-0-0-7`).

A Service with `kv_events` set (opt-in; the chart's engine groups set it) says its engines
publish KV cache events on TCP (docs/prefix_cache.md): each engine's spec gets
`tcp://<pod address>:<port>` for the Service's ports named `kv-events` and `kv-replay` (api
discovery, when the slice lists them), else the configured numbers.

`endpoints_from_slices` is the pure part; `EndpointSliceSource` and `DnsSource` do the I/O
with injected transports (tests answer from a fake API server over HTTP and a fake resolver).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp

from pools.config import KubernetesEnginesConfig, KubernetesServiceConfig
from pools.discovery.base import DiscoveryError, TimingFromConfig
from pools.launchers.base import InstanceSpec, KvEventsSpec

__all__ = [
    "SERVICE_ACCOUNT_DIR",
    "DnsSource",
    "EndpointSliceSource",
    "endpoints_from_slices",
    "in_cluster_namespace",
    "kv_events_of",
    "make_kubernetes_source",
]

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")

Resolver = Callable[[str, int], Awaitable[list[str]]]


def _url(address: str, port: int, scheme: str = "http") -> str:
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    return f"{scheme}://{host}:{port}"


def _named_port(slice_: Mapping[str, Any] | None, name: str) -> int | None:
    for p in (slice_ or {}).get("ports") or []:
        if isinstance(p, Mapping) and p.get("name") == name and isinstance(p.get("port"), int):
            return int(p["port"])
    return None


def kv_events_of(
    service: KubernetesServiceConfig, address: str, slice_: Mapping[str, Any] | None = None
) -> KvEventsSpec | None:
    """Where the engine at `address` publishes its KV events: the slice's ports named
    `kv-events`/`kv-replay` when it lists them, else the service's configured ones; None
    when the service does not opt in."""
    events = service.kv_events
    if events is None:
        return None
    pub = _named_port(slice_, "kv-events") or events.port
    replay = _named_port(slice_, "kv-replay") or events.replay_port
    return KvEventsSpec(
        endpoint=_url(address, pub, "tcp"),
        replay_endpoint=None if replay is None else _url(address, replay, "tcp"),
        hash_seed=events.hash_seed,
    )


def _port_of(slice_: Mapping[str, Any], service: KubernetesServiceConfig) -> int | None:
    """The slice's port for the engines: the configured number if listed, else the one named
    `http`, else the only one."""
    ports = [p for p in slice_.get("ports") or [] if isinstance(p, Mapping)]
    for p in ports:
        if p.get("port") == service.port:
            return service.port
    named = [p.get("port") for p in ports if p.get("name") == "http"]
    if named and isinstance(named[0], int):
        return named[0]
    if len(ports) == 1 and isinstance(ports[0].get("port"), int):
        return int(ports[0]["port"])
    return None


def endpoints_from_slices(
    slices: Iterable[Mapping[str, Any]],
    service: KubernetesServiceConfig,
    api_key: str | None = None,
) -> list[InstanceSpec]:
    """The engines that should take traffic, from one Service's EndpointSlices (the `items`
    of a list answer), sorted by instance id. An endpoint listed in two slices (as happens
    while a slice is replaced) counts once."""
    found: dict[str, InstanceSpec] = {}
    for slice_ in slices:
        if slice_.get("addressType", "IPv4") not in ("IPv4", "IPv6"):
            continue
        port = _port_of(slice_, service)
        if port is None:
            continue
        for endpoint in slice_.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            if conditions.get("ready") is False or conditions.get("terminating") is True:
                continue
            addresses = endpoint.get("addresses") or []
            if not addresses:
                continue
            address = str(addresses[0])
            ref = endpoint.get("targetRef") or {}
            if ref.get("kind") == "Pod" and ref.get("name"):
                instance_id = str(ref["name"])
            elif endpoint.get("hostname"):
                instance_id = str(endpoint["hostname"])
            else:
                instance_id = f"{service.name}-{address.replace('.', '-').replace(':', '-')}"
            found[instance_id] = InstanceSpec(
                instance_id=instance_id,
                url=_url(address, port),
                gpus=service.gpus_per_instance,
                api_key=api_key,
                kv_events=kv_events_of(service, address, slice_),
            )
    return [found[i] for i in sorted(found)]


def in_cluster_namespace(account_dir: Path = SERVICE_ACCOUNT_DIR) -> str:
    """The pod's own namespace (its service account's), else `default`."""
    try:
        return (account_dir / "namespace").read_text().strip() or "default"
    except OSError:
        return "default"


class EndpointSliceSource(TimingFromConfig):
    """Lists each Service's EndpointSlices through the API server, every poll.

    `api_url` defaults to the in-cluster address (`KUBERNETES_SERVICE_HOST`/`_PORT`); the
    token is re-read from `token_path` on every poll (projected tokens rotate); `ca_path`
    verifies the API server. A `session` may be given (tests); else one is opened on the
    first poll and closed by `aclose()`."""

    _config: KubernetesEnginesConfig

    def __init__(
        self,
        config: KubernetesEnginesConfig,
        *,
        namespace: str,
        api_url: str,
        token_path: Path | None = SERVICE_ACCOUNT_DIR / "token",
        ca_path: Path | None = SERVICE_ACCOUNT_DIR / "ca.crt",
        timeout_s: float = 5.0,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self._config = config
        self._namespace = namespace
        self._api_url = api_url.rstrip("/")
        self._token_path = token_path
        self._ca_path = ca_path
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session = session
        self._own_session = session is None

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self._token_path is not None:
            try:
                headers["Authorization"] = "Bearer " + self._token_path.read_text().strip()
            except OSError as err:
                raise DiscoveryError(
                    f"cannot read the service account token {self._token_path}: {err.strerror}"
                ) from None
        return headers

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            ssl_context: ssl.SSLContext | bool = True
            if self._ca_path is not None and self._ca_path.is_file():
                ssl_context = ssl.create_default_context(cafile=str(self._ca_path))
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=ssl_context, limit=4)
            )
        return self._session

    async def poll(self) -> list[InstanceSpec]:
        session = self._open()
        headers = self._headers()
        specs: list[InstanceSpec] = []
        for service in self._config.services:
            selector = quote(f"kubernetes.io/service-name={service.name}", safe="")
            url = (
                f"{self._api_url}/apis/discovery.k8s.io/v1/namespaces/"
                f"{quote(self._namespace, safe='')}/endpointslices?labelSelector={selector}"
            )
            try:
                async with session.get(url, headers=headers, timeout=self._timeout) as resp:
                    if resp.status != 200:
                        detail = (await resp.text())[:200]
                        raise DiscoveryError(
                            f"listing EndpointSlices of Service {service.name!r} in namespace"
                            f" {self._namespace!r}: the API server answered {resp.status}"
                            f" ({detail}){_rbac_hint(resp.status)}"
                        )
                    doc = await resp.json(content_type=None)
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as err:
                raise DiscoveryError(
                    f"listing EndpointSlices of Service {service.name!r}:"
                    f" {type(err).__name__}: {err}"
                ) from None
            items = doc.get("items") if isinstance(doc, dict) else None
            if not isinstance(items, list):
                raise DiscoveryError(f"the EndpointSlice list of {service.name!r} has no items")
            specs += endpoints_from_slices(items, service, self._config.api_key)
        return specs

    async def aclose(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
        self._session = None


def _rbac_hint(status: int) -> str:
    if status in (401, 403):
        return (
            "; the router's service account needs get/list on endpointslices"
            " (discovery.k8s.io) in that namespace: the chart's Role grants it"
        )
    return ""


async def _getaddrinfo(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to; [] when the name does not exist (a headless Service
    with no ready pod has no records)."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        if err.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return []
        raise DiscoveryError(f"resolving {host}: {err}") from None
    return sorted({str(info[4][0]) for info in infos})


class DnsSource(TimingFromConfig):
    """The headless Services' A/AAAA records, every poll. `resolve(host, port)` is injected
    (default: the system resolver through `getaddrinfo`)."""

    _config: KubernetesEnginesConfig

    def __init__(
        self,
        config: KubernetesEnginesConfig,
        *,
        namespace: str,
        resolve: Resolver = _getaddrinfo,
    ) -> None:
        self._config = config
        self._namespace = namespace
        self._resolve = resolve

    def host(self, service: KubernetesServiceConfig) -> str:
        return f"{service.name}.{self._namespace}.svc.{self._config.cluster_domain}"

    async def poll(self) -> list[InstanceSpec]:
        specs: list[InstanceSpec] = []
        for service in self._config.services:
            for address in await self._resolve(self.host(service), service.port):
                specs.append(
                    InstanceSpec(
                        instance_id=f"{service.name}-{address.replace('.', '-').replace(':', '-')}",
                        url=_url(address, service.port),
                        gpus=service.gpus_per_instance,
                        api_key=self._config.api_key,
                        kv_events=kv_events_of(service, address),
                    )
                )
        return specs

    async def aclose(self) -> None:
        """Nothing to close."""


def make_kubernetes_source(
    config: KubernetesEnginesConfig,
    environ: Mapping[str, str],
    account_dir: Path = SERVICE_ACCOUNT_DIR,
) -> EndpointSliceSource | DnsSource:
    """The source `engines.kubernetes.discovery` names, for a router running in a pod."""
    namespace = config.namespace or in_cluster_namespace(account_dir)
    if config.discovery == "dns":
        return DnsSource(config, namespace=namespace)
    host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
    if not host:
        raise DiscoveryError(
            "engines.kubernetes.discovery 'api' needs the in-cluster API address"
            " (KUBERNETES_SERVICE_HOST is not set: is the router running in a pod?); use"
            " discovery 'dns', or the static launcher outside the cluster"
        )
    host = f"[{host}]" if ":" in host else host
    return EndpointSliceSource(
        config,
        namespace=namespace,
        api_url=f"https://{host}:{port or 443}",
        token_path=account_dir / "token",
        ca_path=account_dir / "ca.crt",
    )
