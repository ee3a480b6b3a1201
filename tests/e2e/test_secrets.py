"""Sentinel secrets: the node token and the admin token never leave their config files.

Edge and Node run at DEBUG. Every wrong token a test presents *starts with* the real
sentinel, so an echo of either the presented or the expected token shows up.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio

from e2e.harness import BIG, FAST, drained, edge_config, node_config, open_stack, write_config

NODE_SECRET = "SENTINEL-NODE-7f3a"
ADMIN_SECRET = "SENTINEL-ADMIN-91bc"
SECRETS = (NODE_SECRET, ADMIN_SECRET)
HANG = 300.0
"""Seconds after which a wait is taken for a hang: a bound, never a budget (a busy machine is slow)."""

MISPLACED = f"""\
listen: 127.0.0.1:0
node_listen: 127.0.0.1:0
admin_token: {ADMIN_SECRET}
nodes:
  - id: node-a
    token: {NODE_SECRET}
    providers:
      - {{id: gpu0, capacity: 1, secret: {ADMIN_SECRET}}}
models:
  - id: "ornith:35b"
    candidates: [{{node: node-a, provider: gpu0, upstream_model: {NODE_SECRET}x}}]
    token: {NODE_SECRET}
"""
"""A rejected file with the secrets also written where they do not belong."""


def shown(response: httpx.Response) -> str:
    """Everything a client sees of a response: status line, headers, body."""
    headers = "\n".join(f"{k}: {v}" for k, v in response.headers.items())
    return f"{response.status_code}\n{headers}\n{response.text}"


@pytest.mark.req("contract-spec-sync")
async def test_tokens_never_appear_in_logs_status_or_error_bodies(tmp_path: Path) -> None:
    """[contract-spec-sync] (docs/edge-config.md, Secrets) Requests, a node registering with
    a wrong token (exit 3), admin reloads with no token, a wrong token, and the right token on
    a file that misplaces the secrets (400 with every error), then a valid reload: neither
    token appears in any daemon's stderr, /status, /metrics or any answer."""
    seen: list[str] = []
    with trio.fail_after(HANG):
        async with open_stack(tmp_path) as stack:
            await stack.start_backend(latency_ms=20)
            config = edge_config(node_token=NODE_SECRET, admin_token=ADMIN_SECRET)
            await stack.start_edge(config, log_level="DEBUG")
            await stack.start_node(node_config(token=NODE_SECRET), log_level="DEBUG")
            assert stack.edge is not None and stack.edge_config_path is not None
            answers = [await stack.chat(BIG), await stack.chat(FAST, stream=True)]

            intruder = await stack.start_node(
                node_config(token=NODE_SECRET + "-wrong"),
                wait_registered=False,
                log_level="DEBUG",
                name="intruder",
            )
            intruder_exit = await intruder.wait(HANG)

            reload = f"{stack.base_url}/admin/reload"
            no_token = await stack.http.post(reload)
            wrong = await stack.http.post(reload, headers={"authorization": f"Bearer {ADMIN_SECRET}-wrong"})
            admin = {"authorization": f"Bearer {ADMIN_SECRET}"}
            write_config(stack.edge_config_path, MISPLACED)
            rejected = await stack.http.post(reload, headers=admin, timeout=HANG)  # answered once read
            write_config(stack.edge_config_path, config)
            applied = await stack.http.post(reload, headers=admin, timeout=HANG)
            errors = [
                await stack.chat("no-such-model"),
                await stack.http.post(f"{stack.base_url}/v1/chat/completions", content=b"{"),
                await stack.http.get(f"{stack.base_url}/nowhere"),
            ]
            status = await stack.wait_status(drained)
            metrics = await stack.http.get(f"{stack.base_url}/metrics")
            seen += [shown(r) for r in (*answers, no_token, wrong, rejected, applied, *errors, metrics)]
            seen.append(str(status))
            for daemon in stack.daemons:
                if daemon.running:
                    await daemon.stop()
                seen.append(daemon.stderr())
    assert [r.status_code for r in answers] == [200, 200]
    assert intruder_exit == 3
    assert "bad_token" in intruder.stderr()
    assert "rejected node registration node-a from 127.0.0.1: invalid token (bad_token)" in stack.edge.stderr()
    assert (no_token.status_code, wrong.status_code) == (401, 401)
    assert rejected.status_code == 400
    assert rejected.json()["error"]["code"] == "config_rejected"
    assert len(rejected.json()["errors"]) == 2
    assert applied.status_code == 200
    assert [r.status_code for r in errors] == [404, 400, 404]
    assert sum("DEBUG" in text for text in seen) >= 3  # the Edge, node and intruder logs were read
    for text in seen:
        for secret in SECRETS:
            assert secret not in text
