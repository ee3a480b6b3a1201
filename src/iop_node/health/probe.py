"""One provider's readiness probe on the wire: :class:`ProbeClient`.

A probe has its own connection to the backend, never one of the provider's run
pool: a provider whose every pooled connection carries a long stream must still
answer its probe, and a probe must not wait behind runs for a connection. For a
plain ``http://`` backend it is the Node's own :class:`~iop_node.upstream.pool.H11Transport`
with one keep-alive connection (a probe costs one ``send`` and the reads of a short
answer, its request bytes written by h11 once per path); for ``https://`` an
``httpx.AsyncClient`` with one connection.
"""

from __future__ import annotations

from typing import Final, final

import httpx
import trio

from iop_node.adapters.openai_compat import server_root
from iop_node.config import ProviderConfig
from iop_node.health.readiness import ProbeResult, judge, probe_paths
from iop_node.upstream.http11 import written
from iop_node.upstream.pool import H11Transport

ANSWER_BYTES: Final = 1024 * 1024
"""The most bytes of a probe answer's body the node reads (vLLM's ``/metrics`` is the largest)."""


def probe_urls(provider: ProviderConfig) -> tuple[str, tuple[httpx.URL, ...]]:
    """``provider``'s probe kind (``auto`` resolved; not ``none``) and the URL of each of its paths."""
    assert provider.base_url is not None  # a probed provider is an HTTP one (NodeConfig.problems)
    kind = provider.health.probe_for(provider.adapter)
    api = provider.base_url.rstrip("/")
    root = server_root(api)
    return kind, tuple(httpx.URL((api if kind == "openai" else root) + path) for path in probe_paths(kind))


@final
class ProbeClient:
    """Asks one provider's backend whether it is ready (:meth:`check`).

    Attributes:
        kind: the probe kind (``openai``, ``llama_cpp``, ``vllm``, ``ollama``).
        urls: the URL of each path of :func:`~iop_node.health.readiness.probe_paths`.
    """

    __slots__ = ("kind", "urls", "_requests", "_h11", "_client", "_timeouts")

    def __init__(
        self,
        kind: str,
        urls: tuple[httpx.URL, ...],
        timeout: float,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.kind = kind
        self.urls = urls
        self._timeouts: dict[str, float | None] = {
            "connect": timeout,
            "read": timeout,
            "write": timeout,
            "pool": timeout,
        }
        self._h11: H11Transport | None = None
        self._client: httpx.AsyncClient | None = None
        if transport is None and all(url.scheme == "http" for url in urls):
            self._h11 = H11Transport(1)
            self._requests = tuple(written(b"GET", url, [(b"host", url.netloc)], b"") for url in self.urls)
        else:
            self._client = httpx.AsyncClient(
                transport=transport, timeout=timeout, limits=httpx.Limits(max_connections=1)
            )
            self._requests = ()

    def __repr__(self) -> str:
        return f"<ProbeClient {self.kind} {self.urls[0] if self.urls else ''}>"

    async def check(self, limit: float) -> ProbeResult:
        """Probe once: every path in order, the whole exchange within ``limit`` seconds.

        Never raises for the backend's sake: an unreachable backend, a timeout or an
        unreadable answer is a failed probe with its reason. Checkpoints; cancellation
        closes the probe's connection.
        """
        answers: list[tuple[int, bytes]] = []
        with trio.move_on_after(limit) as scope:
            try:
                for index in range(len(self.urls)):
                    answers.append(await self._get(index))
                    if index == 0 and not 200 <= answers[0][0] < 300:
                        break
            except httpx.HTTPError as exc:
                if not answers:
                    return ProbeResult(False, f"unreachable: {exc or type(exc).__name__}")
        if scope.cancelled_caught:
            await self._reset()
            if not answers:
                return ProbeResult(False, f"no answer within {limit:g} s")
        return judge(self.kind, tuple(answers))

    async def _get(self, index: int) -> tuple[int, bytes]:
        if self._h11 is None:
            assert self._client is not None
            response = await self._client.get(self.urls[index])
            return response.status_code, response.content[:ANSWER_BYTES]
        answer = await self._h11.send_written(self.urls[index], self._requests[index], self._timeouts)
        body = b""
        try:
            while (chunk := await answer.next_chunk()) is not None:
                body += chunk
                if len(body) > ANSWER_BYTES:
                    break
        finally:
            answer.close()  # nothing left to read: a no-op, the connection already went back
        return answer.status, body[:ANSWER_BYTES]

    async def _reset(self) -> None:
        """Drop the connection of a probe that timed out (a half-read answer must not be reused)."""
        if self._h11 is not None:
            await self._h11.aclose()
            self._h11 = H11Transport(1)

    async def aclose(self) -> None:
        """Close the probe's connection. Checkpoints."""
        if self._h11 is not None:
            await self._h11.aclose()
        if self._client is not None:
            await self._client.aclose()
