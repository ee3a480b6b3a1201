"""[http-framing] The attack of issue 27 against a whole Edge (API keys off, an admin token set): a
``POST /admin/reload`` smuggled in the chunks of a request that also carries ``Content-Length`` is
never executed, and the Edge serves the next connection."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from edge.harness import ADMIN_TOKEN, running_edge
from framing.listener import exchange, statuses

SMUGGLED = (
    b"POST /admin/reload HTTP/1.1\r\nhost: edge\r\nauthorization: Bearer %b\r\ncontent-length: 0\r\n\r\n"
    % ADMIN_TOKEN.encode()
)
CARRIERS = [
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: edge\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n"
    b"0\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: edge\r\ncontent-length: 5\r\nx-a: b\r\n transfer-encoding: chunked"
    b"\r\n\r\n0\r\n\r\n",
]


@pytest.mark.req("http-framing")
async def test_a_smuggled_admin_reload_is_never_executed(tmp_path: Path) -> None:
    """[http-framing] Content-Length beside Transfer-Encoding (plain, or in an obs-fold): 400 and close;
    the admin request in the body never runs; the Edge serves the next connection."""
    calls: list[None] = []
    with trio.fail_after(20):
        async with running_edge(tmp_path) as edge:
            reload = edge.service.reload

            async def counted() -> list[str]:
                calls.append(None)
                return await reload()

            edge.service.reload = counted  # type: ignore[method-assign]
            for carrier in CARRIERS:
                received = await exchange(edge.http_port, carrier + SMUGGLED)
                assert [status for status, _ in statuses(received)] == [400], received[:300]
                assert b"/admin/reload" not in received and ADMIN_TOKEN.encode() not in received
                assert calls == []
                response = await edge.http.get("/healthz")
                assert response.status_code == 200
            await exchange(edge.http_port, SMUGGLED)  # the same request sent as itself runs
            assert calls == [None]
