"""A small etcd v3 client over etcd's JSON gateway (``/v3/...``).

Chosen over a gRPC client library: the five calls the election needs (lease
grant, keepalive, revoke, a create-if-absent transaction, a range read) are
one POST each, and the gateway ships in every etcd 3.x server. The POSTs go
through :class:`~iop_edge.ha.etcd_http.EtcdHttp` (one kept connection per
endpoint, the project's own HTTP/1.1): a leader makes one every third of its
TTL for as long as it runs, so their cost is HA's steady cost. Keys and values are base64 in the gateway's JSON; 64-bit
numbers are strings. With etcd's auth enabled, the gateway authenticates once
(``/v3/auth/authenticate``) and sends the token etcd gave it in the
``Authorization`` header of every call, authenticating again when etcd
answers 401 (the token expired, or etcd restarted). Every call is a checkpoint; cancelling one abandons the
request (etcd may still have applied it: the election is written so that a
lost answer costs at most one lease TTL).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from typing import Any, Protocol, final

import attrs

from iop_edge.ha.etcd_http import CallFailed, Headers

LEASE_NOT_FOUND = "requested lease not found"
"""etcd's error for a lease it does not have (``rpctypes.ErrLeaseNotFound``), in its gateway's answer."""


class EtcdUnavailable(Exception):
    """No endpoint answered the call (connection refused, timeout, or a non-200 answer)."""


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode()


class Poster(Protocol):
    """What the gateway needs of an HTTP client: :class:`~iop_edge.ha.etcd_http.EtcdHttp`, or a stand-in."""

    async def post(self, url: str, body: bytes, headers: Headers = ()) -> tuple[int, bytes]:
        """The answer's status and body; raises :class:`~iop_edge.ha.etcd_http.CallFailed` when none came."""
        ...


@final
@attrs.frozen
class KeyHolder:
    """The election key's value (the holder's name) and the revision that created it."""

    value: str
    create_revision: int


@final
@attrs.define(eq=False)
class EtcdGateway:
    """Calls to etcd's JSON gateway, trying ``endpoints`` in turn.

    Args:
        client: the HTTP client (:class:`~iop_edge.ha.etcd_http.EtcdHttp`, TLS configured on it).
        endpoints: base URLs, e.g. ``http://10.0.0.1:2379``.
        credentials: ``(user, password)`` when etcd's auth is enabled; None: no auth.
    """

    client: Poster
    endpoints: Sequence[str]
    credentials: tuple[str, str] | None = attrs.field(default=None, repr=False)
    _next: int = 0
    _token: str | None = attrs.field(default=None, repr=False)

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        last: Exception | None = None
        data = json.dumps(body, separators=(",", ":")).encode()
        for i in range(len(self.endpoints)):
            endpoint = self.endpoints[(self._next + i) % len(self.endpoints)]
            try:
                status, text = await self._call(endpoint.rstrip("/"), path, data)
                if status != 200:
                    raise EtcdUnavailable(f"{endpoint}{path}: {status} {text[:200].decode(errors='replace')}")
                answer = json.loads(text)
                if not isinstance(answer, dict):
                    raise EtcdUnavailable(f"{endpoint}{path}: not a JSON object: {text[:200]!r}")
            except (CallFailed, EtcdUnavailable, ValueError) as error:
                last = error
                continue
            self._next = (self._next + i) % len(self.endpoints)
            return answer
        raise EtcdUnavailable(str(last))

    async def _call(self, endpoint: str, path: str, body: bytes) -> tuple[int, bytes]:
        """One POST, with the auth token when etcd's auth is on (a new one after a 401)."""
        if self.credentials is None:
            return await self.client.post(endpoint + path, body)
        for attempt in range(2):
            if self._token is None or attempt:
                self._token = await self._authenticate(endpoint, *self.credentials)
            status, text = await self.client.post(endpoint + path, body, [(b"authorization", self._token.encode())])
            if status != 401:
                break
        return status, text

    async def _authenticate(self, endpoint: str, user: str, password: str) -> str:
        status, text = await self.client.post(
            endpoint + "/v3/auth/authenticate", json.dumps({"name": user, "password": password}).encode()
        )
        if status != 200:
            raise EtcdUnavailable(
                f"{endpoint}: etcd refused user {user!r}: {status} {text[:200].decode(errors='replace')}"
            )
        token: str = json.loads(text)["token"]
        return token

    async def grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; returns its id."""
        return int((await self._post("/v3/lease/grant", {"TTL": ttl}))["ID"])

    async def keepalive(self, lease: int) -> int:
        """Renew ``lease`` once; returns the TTL etcd granted (0: the lease is gone)."""
        answer = await self._post("/v3/lease/keepalive", {"ID": str(lease)})
        return int(answer.get("result", {}).get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        """Revoke ``lease`` (its keys go with it); one etcd no longer has (expired, revoked) is no error."""
        try:
            await self._post("/v3/lease/revoke", {"ID": str(lease)})
        except EtcdUnavailable as error:
            if LEASE_NOT_FOUND not in str(error):
                raise

    async def create(self, key: str, value: str, lease: int) -> tuple[bool, KeyHolder | None]:
        """Put ``key`` = ``value`` under ``lease`` only if ``key`` does not exist.

        Returns ``(True, holder)`` when this call created it (``holder.create_revision``
        is the new revision), else ``(False, current holder or None)``.
        """
        k = _b64(key)
        answer = await self._post(
            "/v3/kv/txn",
            {
                "compare": [{"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
                "success": [{"request_put": {"key": k, "value": _b64(value), "lease": str(lease)}}],
                "failure": [{"request_range": {"key": k}}],
            },
        )
        if answer.get("succeeded"):
            return True, KeyHolder(value, int(answer["header"]["revision"]))
        kvs = answer.get("responses", [{}])[0].get("response_range", {}).get("kvs", [])
        return False, self._holder(kvs)

    async def holder(self, key: str) -> KeyHolder | None:
        """Who holds ``key`` now, or ``None``."""
        return self._holder((await self._post("/v3/kv/range", {"key": _b64(key)})).get("kvs", []))

    @staticmethod
    def _holder(kvs: list[dict[str, Any]]) -> KeyHolder | None:
        if not kvs:
            return None
        return KeyHolder(_unb64(kvs[0].get("value", "")), int(kvs[0]["create_revision"]))
