"""Real-process stacks for end-to-end tests: mock backend, Edge and Node as separate processes.

Every daemon runs as ``sys.executable -m <module>`` on 127.0.0.1 port 0, with its config
written to the test's ``tmp_path``. Ports are parsed from the ready lines the daemons print
on stderr (the Node's ``edge_url`` needs the Edge's node port, so the Edge starts first).
Each child's stderr goes straight into a file (``<name>-<n>.stderr`` in the stack's
directory): the OS writes it, so a chatty child can never block on a full pipe, and tests
assert on the file afterwards.

Use :func:`open_stack`; its exit kills and reaps every child still running, whatever
happened in the test::

    async with open_stack(tmp_path) as stack:
        await stack.start_backend(latency_ms=200)
        await stack.start_edge(edge_config())
        await stack.start_node(node_config())
        status = await stack.status()

The config builders return plain dicts; they are written as JSON, which is YAML. A test
that needs a particular file (an invalid one, say) passes the text instead.

Import it as ``from e2e.harness import ...`` (``tests/e2e`` is a package, so pytest puts
``tests/`` on ``sys.path``; a suite elsewhere under ``tests/`` needs an ``__init__.py`` too).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, final

import attrs
import httpx
import trio

BIG = "ornith:35b"
FAST = "ornith-fast"
NODE_ID = "node-a"
NODE_TOKEN = "e2e-node-token"
READY_TIMEOUT = 15.0
"""Seconds a daemon has to print its ready line."""
STOP_TIMEOUT = 5.0
"""Seconds a daemon has to exit after SIGTERM/SIGINT before it is killed."""
POLL_INTERVAL = 0.02
"""Seconds between two looks at a stderr file or at ``/status`` (there is no event to wait on)."""

EDGE_READY = re.compile(r"iop-edge listening: http://[^ ]+:(\d+) \(API\), ws://[^ ]+:(\d+) \(nodes\)")
BACKEND_READY = re.compile(r"iop-mock-backend listening on http://[^ ]+:(\d+)")
NODE_REGISTERED = re.compile(r"registered as (\S+), generation (\d+)")


class DaemonExited(Exception):
    """A daemon exited while a test was waiting for it."""


# ----------------------------------------------------------------- configs


def edge_config(
    *,
    providers: Mapping[str, int] | None = None,
    models: Mapping[str, Sequence[str]] | None = None,
    heartbeat_timeout_ms: int = 15_000,
    max_queue: int = 64,
    queue_timeout_ms: int = 30_000,
    node_token: str = NODE_TOKEN,
    **extra: Any,
) -> dict[str, Any]:
    """An ``edge.yaml`` as a dict: one node, ``node-a``, listening on port 0.

    Args:
        providers: provider id -> capacity (default: ``{"gpu0": 1}``).
        models: model key -> candidate provider ids, in order (default: ``ornith:35b``
            and ``ornith-fast`` both on ``gpu0`` only).
        heartbeat_timeout_ms, max_queue, queue_timeout_ms: as in ``edge.yaml``.
        node_token: the token ``node-a`` must present.
        extra: further top-level keys (``admin_token``, ``api_keys``, ...).
    """
    providers = {"gpu0": 1} if providers is None else providers
    models = {BIG: ["gpu0"], FAST: ["gpu0"]} if models is None else models
    return {
        "listen": "127.0.0.1:0",
        "node_listen": "127.0.0.1:0",
        "heartbeat_timeout_ms": heartbeat_timeout_ms,
        "provider_pool": {"max_queue": max_queue, "queue_timeout_ms": queue_timeout_ms},
        "nodes": [
            {
                "id": NODE_ID,
                "token": node_token,
                "providers": [{"id": pid, "capacity": cap} for pid, cap in providers.items()],
            }
        ],
        "models": [
            {
                "id": model,
                "candidates": [{"node": NODE_ID, "provider": pid, "upstream_model": "qwen3:35b"} for pid in pids],
            }
            for model, pids in models.items()
        ],
        **extra,
    }


def node_config(
    *,
    providers: Mapping[str, int] | None = None,
    token: str = NODE_TOKEN,
    heartbeat_interval_ms: int = 5_000,
    concurrency: int = 8,
) -> dict[str, Any]:
    """A ``node.yaml`` as a dict; :meth:`Stack.start_node` fills in ``edge_url`` and the
    backend's ``base_url``.

    Args:
        providers: provider id -> node-side capacity (default ``{"gpu0": 1}``); every
            provider uses the ``openai`` adapter in front of the stack's mock backend.
        token: the registration token.
        heartbeat_interval_ms: the node's heartbeat period (it uses the smaller of this
            and the Edge's ``heartbeat_timeout / 3``).
        concurrency: ``runtime.concurrency``.
    """
    providers = {"gpu0": 1} if providers is None else providers
    return {
        "node_id": NODE_ID,
        "token": token,
        "heartbeat_interval_ms": heartbeat_interval_ms,
        "runtime": {"concurrency": concurrency},
        "reconnect": {"initial_ms": 50, "max_ms": 500},
        "providers": [{"id": pid, "adapter": "openai", "capacity": cap} for pid, cap in providers.items()],
    }


def write_config(path: Path, config: Mapping[str, Any] | str) -> Path:
    """Write ``config`` (a dict, as JSON, or YAML text as is) to ``path``."""
    text = config if isinstance(config, str) else json.dumps(config, indent=2) + "\n"
    path.write_text(text)
    return path


# ----------------------------------------------------------------- daemons


@final
@attrs.define(eq=False)
class Daemon:
    """One child process and the file its stderr goes to."""

    name: str
    process: trio.Process
    stderr_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def stderr(self) -> str:
        """Everything the daemon wrote to stderr so far."""
        return self.stderr_path.read_text(errors="replace")

    async def wait_for_line(
        self, pattern: re.Pattern[str] | str, *, count: int = 1, timeout: float = READY_TIMEOUT
    ) -> re.Match[str]:
        """Wait until ``pattern`` matched ``count`` times in the stderr file; return the last match.

        Checkpoints (polls the file). Cancellation just stops waiting.

        Raises:
            DaemonExited: the process exited first (the message holds its stderr).
            trio.TooSlowError: not seen within ``timeout`` seconds.
        """
        regex = re.compile(pattern)
        with trio.fail_after(timeout):
            while True:
                matches = list(regex.finditer(self.stderr()))
                if len(matches) >= count:
                    return matches[count - 1]
                if not self.running:
                    raise DaemonExited(
                        f"{self.name} exited with {self.process.returncode} before printing "
                        f"{regex.pattern!r}:\n{self.stderr()}"
                    )
                await trio.sleep(POLL_INTERVAL)

    def send_signal(self, signum: int) -> None:
        """Send ``signum`` to this process (only to it, never to a group)."""
        if self.running:
            self.process.send_signal(signum)

    def terminate(self) -> None:
        """SIGTERM: a graceful shutdown."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL: the process vanishes; the kernel closes its sockets without a WebSocket close."""
        self.send_signal(signal.SIGKILL)

    def sigstop(self) -> None:
        """SIGSTOP: the process freezes with its sockets open (a blackholed peer)."""
        self.send_signal(signal.SIGSTOP)

    def sigcont(self) -> None:
        """SIGCONT: resume after :meth:`sigstop`."""
        self.send_signal(signal.SIGCONT)

    async def wait(self, timeout: float = STOP_TIMEOUT) -> int:
        """Wait for the exit; return the exit code (negative: killed by that signal).

        Checkpoints. Cancellation leaves the process running.

        Raises:
            trio.TooSlowError: still running after ``timeout`` seconds.
        """
        with trio.fail_after(timeout):
            return await self.process.wait()

    async def stop(self, signum: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT) -> int:
        """Send ``signum`` and wait for the exit; kill it if it outlives ``timeout``."""
        self.send_signal(signum)
        try:
            return await self.wait(timeout)
        except trio.TooSlowError:
            await self.reap()
            raise

    async def reap(self) -> None:
        """SIGKILL (also ends a stopped process) and wait. Safe in ``finally``: shielded, bounded."""
        if self.running:
            self.process.kill()
        with trio.CancelScope(shield=True), trio.move_on_after(STOP_TIMEOUT):
            await self.process.wait()


# ------------------------------------------------------------------- stack


@final
@attrs.define(eq=False)
class Stack:
    """Mock backend, Edge and Node processes of one test, and an HTTP client for the Edge.

    Build it with :func:`open_stack`. ``backend``, ``edge`` and ``node`` are the
    latest daemon of each kind; ``daemons`` holds every one ever started.

    Every async method checkpoints. Cancellation just stops the waiting (or the HTTP
    call); a process already started stays in ``daemons`` and :meth:`aclose` reaps it.
    ``start_*`` raise :class:`DaemonExited` or ``trio.TooSlowError`` when a daemon dies
    or stays silent instead of getting ready.
    """

    directory: Path
    http: httpx.AsyncClient = attrs.field(factory=lambda: httpx.AsyncClient(timeout=10.0))
    daemons: list[Daemon] = attrs.field(factory=list)
    backend: Daemon | None = None
    edge: Daemon | None = None
    node: Daemon | None = None
    backend_port: int | None = None
    http_port: int | None = None
    node_port: int | None = None
    edge_config_path: Path | None = None
    env: dict[str, str] = attrs.field(factory=lambda: dict(os.environ))

    # ------------------------------------------------------------- start

    async def spawn(self, name: str, args: Sequence[str]) -> Daemon:
        """Start ``sys.executable *args`` with stderr into ``<name>-<n>.stderr``."""
        n = sum(1 for d in self.daemons if d.name == name) + 1
        path = self.directory / f"{name}-{n}.stderr"
        with path.open("wb") as stderr:
            process = await trio.lowlevel.open_process(
                [sys.executable, *args],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                env=self.env,
            )
        daemon = Daemon(name, process, path)
        self.daemons.append(daemon)
        return daemon

    async def start_backend(
        self,
        *,
        latency_ms: float = 200,
        tokens_per_second: float = 0,
        track_repeats: bool = False,
        options: Sequence[str] = (),
    ) -> Daemon:
        """Start ``iop_mock`` (the mock backend) on port 0 and wait for its ready line; ``track_repeats``:
        its ``/stats`` counts requests whose body repeats one served before (``repeated``); ``options``:
        further command-line options (``--kv-tokens``, ...)."""
        argv = ["-m", "iop_mock", "--port", "0", "--latency-ms", str(latency_ms)]
        argv += ["--tokens-per-second", str(tokens_per_second), *options]
        daemon = await self.spawn("backend", [*argv, "--track-repeats"] if track_repeats else argv)
        self.backend = daemon
        self.backend_port = int((await daemon.wait_for_line(BACKEND_READY))[1])
        return daemon

    async def start_edge(self, config: Mapping[str, Any] | str, *, log_level: str = "INFO") -> Daemon:
        """Write ``edge.yaml`` and start ``iop_edge``; wait for its listening line."""
        self.edge_config_path = write_config(self.directory / "edge.yaml", config)
        daemon = await self.spawn(
            "edge", ["-m", "iop_edge", "--config", str(self.edge_config_path), "--log-level", log_level]
        )
        self.edge = daemon
        match = await daemon.wait_for_line(EDGE_READY)
        self.http_port, self.node_port = int(match[1]), int(match[2])
        return daemon

    async def start_node(
        self,
        config: Mapping[str, Any] | None = None,
        *,
        wait_registered: bool = True,
        log_level: str = "INFO",
        name: str = "node",
    ) -> Daemon:
        """Write a node config (edge_url and backend base_url filled in) and start ``iop_node``.

        Args:
            config: from :func:`node_config` (default: ``node_config()``).
            wait_registered: wait for the "registered as" line.
            log_level: the node's ``--log-level``.
            name: daemon name; anything but ``"node"`` leaves :attr:`node` alone (a second,
                intruding node process).
        """
        assert self.node_port is not None, "start the Edge first"
        config = dict(node_config() if config is None else config)
        config["edge_url"] = f"ws://127.0.0.1:{self.node_port}"
        if self.backend_port is not None:
            config["providers"] = [
                {"base_url": f"http://127.0.0.1:{self.backend_port}/v1", **p} if p.get("adapter") == "openai" else p
                for p in config["providers"]
            ]
        n = sum(1 for d in self.daemons if d.name == name) + 1
        path = write_config(self.directory / f"{name}-{n}.yaml", config)
        daemon = await self.spawn(name, ["-m", "iop_node", "--config", str(path), "--log-level", log_level])
        if name == "node":
            self.node = daemon
        if wait_registered:
            await daemon.wait_for_line(NODE_REGISTERED)
        return daemon

    # ------------------------------------------------------------- look

    @property
    def base_url(self) -> str:
        assert self.http_port is not None, "start the Edge first"
        return f"http://127.0.0.1:{self.http_port}"

    async def status(self) -> dict[str, Any]:
        """``GET /status`` of the Edge."""
        response = await self.http.get(f"{self.base_url}/status")
        response.raise_for_status()
        return response.json()

    async def wait_status(
        self, predicate: Callable[[dict[str, Any]], bool], *, timeout: float = READY_TIMEOUT
    ) -> dict[str, Any]:
        """Poll ``/status`` until ``predicate`` holds; return that status.

        Raises:
            trio.TooSlowError: not within ``timeout`` seconds.
        """
        with trio.fail_after(timeout):
            while True:
                status = await self.status()
                if predicate(status):
                    return status
                await trio.sleep(POLL_INTERVAL)

    async def backend_stats(self) -> dict[str, int]:
        """``GET /stats`` of the mock backend: in_flight, peak_in_flight, total."""
        response = await self.http.get(f"http://127.0.0.1:{self.backend_port}/stats")
        response.raise_for_status()
        return response.json()

    async def chat(self, model: str, *, stream: bool = False, max_tokens: int = 4, **body: Any) -> httpx.Response:
        """POST ``/v1/chat/completions`` and read the whole answer (SSE included)."""
        payload = {
            "model": model,
            "stream": stream,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "Hello"}],
            **body,
        }
        return await self.http.post(f"{self.base_url}/v1/chat/completions", json=payload)

    # ------------------------------------------------------------- stop

    async def aclose(self) -> None:
        """Kill and reap every child still running; close the HTTP client. Shielded, bounded."""
        for daemon in reversed(self.daemons):
            await daemon.reap()
        with trio.CancelScope(shield=True), trio.move_on_after(STOP_TIMEOUT):
            await self.http.aclose()


def provider(status: Mapping[str, Any], provider_id: str, node_id: str = NODE_ID) -> dict[str, Any]:
    """The ``/status`` entry of one provider."""
    for entry in status["providers"]:
        if entry["node_id"] == node_id and entry["provider_id"] == provider_id:
            return entry
    raise KeyError(f"{node_id}/{provider_id} not in /status")


def drained(status: Mapping[str, Any]) -> bool:
    """No lease and no waiter anywhere: every provider counter and the queue depth are 0."""
    counters = ("in_flight", "long_in_flight", "queued", "long_queued")
    return status["queue_depth"] == 0 and all(p[name] == 0 for p in status["providers"] for name in counters)


# ---------------------------------------------------------------- requests


def error_code(response: httpx.Response) -> str:
    """The OpenAI error code of an error answer, checked against the reason header."""
    code = response.json()["error"]["code"]
    assert response.headers["x-iop-reject-reason"] == code
    return code


def sse_error_code(response: httpx.Response) -> str | None:
    """The code of a stream's final ``data: {"error": ...}`` event (None: it ended otherwise)."""
    events = [line for line in response.text.splitlines() if line.startswith("data: ")]
    if not events or events[-1] == "data: [DONE]":
        return None
    return json.loads(events[-1][len("data: ") :])["error"]["code"]


@final
@attrs.define(eq=False)
class Requests:
    """Chat requests running in the background, each answered into :attr:`answers`."""

    stack: Stack
    nursery: trio.Nursery
    answers: dict[str, httpx.Response] = attrs.field(factory=dict)
    _done: dict[str, trio.Event] = attrs.field(factory=dict)

    def start(self, name: str, model: str, **body: Any) -> None:
        self._done[name] = done = trio.Event()

        async def ask() -> None:
            self.answers[name] = await self.stack.chat(model, **body)
            done.set()

        self.nursery.start_soon(ask)

    async def running(self, name: str, model: str, *, on: str = "gpu0", **body: Any) -> None:
        """Start a request and wait until provider ``on`` holds one more lease."""
        before = provider(await self.stack.status(), on)["in_flight"]
        self.start(name, model, **body)
        await self.stack.wait_status(lambda s: provider(s, on)["in_flight"] == before + 1)

    async def streaming(self, name: str, model: str, **body: Any) -> None:
        """Start a streaming request and wait until its first event arrived (head sent)."""
        self._done[name] = done = trio.Event()
        first = trio.Event()
        payload = {"model": model, "stream": True, "messages": [{"role": "user", "content": "Hi"}], **body}

        async def ask() -> None:
            url = f"{self.stack.base_url}/v1/chat/completions"
            async with self.stack.http.stream("POST", url, json=payload) as response:
                received = b""
                async for data in response.aiter_raw():
                    received += data
                    if b"data: " in received:
                        first.set()
            self.answers[name] = httpx.Response(response.status_code, headers=response.headers, content=received)
            first.set()
            done.set()

        self.nursery.start_soon(ask)
        await first.wait()

    async def queued(self, name: str, model: str, **body: Any) -> None:
        """Start a request and wait until the Edge's queue holds one more waiter."""
        before = (await self.stack.status())["queue_depth"]
        self.start(name, model, **body)
        await self.stack.wait_status(lambda s: s["queue_depth"] == before + 1)

    async def answered(self, *, timeout: float) -> dict[str, httpx.Response]:
        """Wait until every request started so far has its answer.

        Raises:
            trio.TooSlowError: some request is still unanswered after ``timeout`` seconds.
        """
        with trio.fail_after(timeout):
            for done in self._done.values():
                await done.wait()
        return self.answers


@asynccontextmanager
async def open_stack(directory: Path) -> AsyncIterator[Stack]:
    """A :class:`Stack` whose children are always killed and reaped on exit."""
    stack = Stack(directory)
    try:
        yield stack
    finally:
        await stack.aclose()
