"""Peer gateways measured in the same run as ours: a LiteLLM proxy (``make bench-peers``).

LiteLLM lives in its own virtualenv, ``benchmarks/.peers`` (git-ignored), created on
first use with ``python -m venv`` and ``pip install litellm[proxy]==LITELLM_VERSION``;
it is never imported into the project's environment and never runs in ``make test``.
The proxy runs as a subprocess on loopback with one model, ``mock``, an
OpenAI-compatible model (``openai/mock``) whose ``api_base`` is the mock backend.
Telemetry, the remote model-cost-map fetch, the UI/docs and spend logging are off, and
no database is configured.

Why the pin: the newest releases' ``proxy`` extra depends on ``litellm-proxy``, which
is not installable from this machine's package index; 1.100.0 is the newest release
whose ``proxy`` extra resolves here.
"""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import trio

from .harness import BenchmarkFailed, Daemon, HttpConnection

ROOT = pathlib.Path(__file__).resolve().parent
VENV = ROOT / ".peers"
LITELLM_VERSION = "1.100.0"
REQUIREMENT = f"litellm[proxy]=={LITELLM_VERSION}"

CONFIG = """\
model_list:
  - model_name: mock
    litellm_params:
      model: openai/mock
      api_base: http://127.0.0.1:{backend_port}/v1
      api_key: sk-bench-not-checked
litellm_settings:
  telemetry: false
  drop_params: true
  set_verbose: false
  request_timeout: 60
general_settings:
  disable_spend_logs: true
  disable_error_logs: true
  background_health_checks: false
"""

ENV = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch of the cost map from the network
    "LITELLM_TELEMETRY": "False",
    "LITELLM_LOG": "ERROR",
    "NO_DOCS": "True",
    "NO_REDOC": "True",
    "DISABLE_ADMIN_UI": "True",
    # LiteLLM ends a stream with an error after 100 identical chunks ("the model is
    # repeating the same chunk"); every token of the mock is "tok ".
    "REPEATED_STREAMING_CHUNK_LIMIT": "1000000",
}


class PeerUnavailable(Exception):
    """The peer cannot be installed or started here; ``str()`` says why."""


def _bin(name: str) -> pathlib.Path:
    return VENV / "bin" / name


def version() -> str:
    """The pinned LiteLLM version."""
    return LITELLM_VERSION


def ensure_installed() -> pathlib.Path:
    """Create ``benchmarks/.peers`` and install LiteLLM there if needed; return ``litellm``'s path.

    Raises:
        PeerUnavailable: the venv cannot be created or pip fails (the last lines of its output).
    """
    litellm = _bin("litellm")
    stamp = VENV / f".installed-{LITELLM_VERSION}"
    if litellm.exists() and stamp.exists():
        return litellm
    print(f"   installing {REQUIREMENT} into {VENV} (first use) ...", file=sys.stderr, flush=True)
    steps = [
        [sys.executable, "-m", "venv", str(VENV)],
        [str(_bin("python")), "-m", "pip", "install", "--quiet", REQUIREMENT],
    ]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            lines = [line for line in (done.stdout + done.stderr).splitlines() if not line.startswith("WARNING")]
            raise PeerUnavailable(f"`{' '.join(step[-3:])}` failed: {' | '.join(lines[-3:])}")
    if not litellm.exists():
        raise PeerUnavailable(f"{REQUIREMENT} installed no `litellm` command")
    stamp.touch()
    return litellm


def free_port() -> int:
    """A loopback port that was free a moment ago (LiteLLM cannot report a port-0 bind)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def router_config(
    groups: Sequence[tuple[str, Sequence[tuple[str, int]]]],
    *,
    timeout_s: float,
    num_retries: int,
    allowed_fails: int,
    cooldown_s: float,
    fallbacks: Sequence[tuple[str, Sequence[str]]] = (),
    health_check_interval_s: int = 0,
    health_check_timeout_s: float = 0.0,
) -> str:
    """A LiteLLM proxy config (JSON, which YAML reads) for deployments of the mock backend.

    ``groups`` is ``[(model_name, [(deployment id, backend port), ...]), ...]``: each deployment an
    OpenAI-compatible ``openai/mock`` at ``http://127.0.0.1:<port>/v1`` with ``timeout`` and
    ``stream_timeout`` of ``timeout_s`` (also the router's ``timeout``). The router retries
    ``num_retries`` times within a group, cools a deployment down for ``cooldown_s`` after
    ``allowed_fails`` failures in a minute, and falls back from a group to the ``fallbacks`` groups
    in order. ``health_check_interval_s`` > 0 turns on the background health checks (a completion
    per deployment each cycle, cut after ``health_check_timeout_s``) and health-check-driven routing
    (a deployment whose last check failed is left out of every pick).
    """
    model_list = [
        {
            "model_name": name,
            "litellm_params": {
                "model": "openai/mock",
                "api_base": f"http://127.0.0.1:{port}/v1",
                "api_key": "sk-bench-not-checked",
                "timeout": timeout_s,
                "stream_timeout": timeout_s,
            },
            "model_info": {"id": deployment}
            | ({"health_check_timeout": health_check_timeout_s} if health_check_interval_s else {}),
        }
        for name, deployments in groups
        for deployment, port in deployments
    ]
    router: dict[str, object] = {
        "routing_strategy": "simple-shuffle",
        "num_retries": num_retries,
        "timeout": timeout_s,
        "allowed_fails": allowed_fails,
        "cooldown_time": cooldown_s,
    }
    if fallbacks:
        router["fallbacks"] = [{name: list(to)} for name, to in fallbacks]
    general: dict[str, object] = {"disable_spend_logs": True, "disable_error_logs": True}
    if health_check_interval_s:
        general |= {
            "background_health_checks": True,
            "health_check_interval": health_check_interval_s,
            "enable_health_check_routing": True,
        }
    else:
        general["background_health_checks"] = False
    settings = {"telemetry": False, "drop_params": True, "set_verbose": False, "request_timeout": timeout_s}
    config = {
        "model_list": model_list,
        "litellm_settings": settings,
        "router_settings": router,
        "general_settings": general,
    }
    return json.dumps(config, indent=2) + "\n"


def ejection_config(port_a: int, port_b: int) -> str:
    """LiteLLM's router for ``benchmarks.health``'s ejection part: model ``m`` on deployments ``gpu0``
    (A) and ``gpu1`` (B), its knobs set to ours -- a health check every 1 s cut after 2 s (the Node's
    probe), health-check-driven routing, 3 allowed failures (``consecutive_failures``), a 6 s cut of
    a call that produced nothing (``stall_ms``), two retries -- and its default 5 s cooldown."""
    return router_config(
        [("m", [("gpu0", port_a), ("gpu1", port_b)])],
        timeout_s=6.0,
        num_retries=2,
        allowed_fails=3,
        cooldown_s=5.0,
        health_check_interval_s=1,
        health_check_timeout_s=2.0,
    )


def deadline_config(dead_port: int, failing_port: int, hung_port: int, deadline_s: float) -> str:
    """LiteLLM's router for ``benchmarks.deadline``: one group per backend (``d0`` -> ``gpu0`` ...),
    fallbacks ``d0 -> d1 -> d2`` (our candidates' order), the client's deadline as every timeout, no
    retry inside a group and no cooldown (ours runs with ejection off)."""
    return router_config(
        [("d0", [("gpu0", dead_port)]), ("d1", [("gpu1", failing_port)]), ("d2", [("gpu2", hung_port)])],
        timeout_s=deadline_s,
        num_retries=0,
        allowed_fails=1_000_000,
        cooldown_s=0.0,
        fallbacks=[("d0", ["d1", "d2"])],
    )


def health_verdict(answer: Mapping[str, Any], deployment: str) -> str:
    """``deployment``'s state in LiteLLM's ``GET /health`` answer (its background checks' last cycle):
    ``ejected`` if listed unhealthy, ``online`` if healthy, ``unknown`` before its first check."""

    def ids(verdict: str) -> set[object]:
        endpoints = answer.get(f"{verdict}_endpoints") or []
        return {endpoint.get("model_id") for endpoint in endpoints if isinstance(endpoint, Mapping)}

    if deployment in ids("unhealthy"):
        return "ejected"
    return "online" if deployment in ids("healthy") else "unknown"


def litellm_command(
    backend_port: int, workdir: pathlib.Path, config_text: str | None = None
) -> tuple[list[str], dict[str, str], int]:
    """Install if needed and return ``(argv, extra env, port)`` of a LiteLLM proxy for the mock.

    ``config_text`` replaces the one-model config (``CONFIG`` for ``backend_port``).

    Raises:
        PeerUnavailable: LiteLLM cannot be installed here.
    """
    litellm = ensure_installed()
    config = workdir / "litellm.yaml"
    config.write_text(config_text if config_text is not None else CONFIG.format(backend_port=backend_port))
    port = free_port()
    argv = [str(litellm), "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]
    return argv, dict(ENV), port


_PROBE = json.dumps({"model": "mock", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}).encode()


async def start_litellm(
    backend_port: int, workdir: pathlib.Path, daemons: list[Daemon], config_text: str | None = None
) -> int:
    """Start a LiteLLM proxy in front of the mock backend; return its port once it answers.

    With ``config_text`` (a :func:`router_config`), "answers" is ``GET /health/liveliness`` = 200
    (its models may be faulty on purpose); without, a chat completion of model ``mock`` = 200.
    """
    argv, env, port = await trio.to_thread.run_sync(litellm_command, backend_port, workdir, config_text)
    litellm = Daemon("litellm", argv, workdir, env)
    daemons.append(litellm)
    probe = HttpConnection("127.0.0.1", port)
    if config_text is None:
        ready = HttpConnection.build("POST", "/v1/chat/completions", _PROBE)
    else:
        ready = HttpConnection.build("GET", "/health/liveliness")

    async def answers() -> bool:
        try:
            status, _ = await probe.request(ready)
        except OSError:
            return False
        if status != 200:
            raise BenchmarkFailed(f"LiteLLM answered {status} to its readiness request:\n{litellm.tail()}")
        return True

    with trio.move_on_after(120):  # its first start imports a lot
        while not await answers():
            litellm.check_alive()
            await trio.sleep(0.25)
        await probe.aclose()
        return port
    raise BenchmarkFailed(f"LiteLLM did not answer within 120 s:\n{litellm.tail()}")
