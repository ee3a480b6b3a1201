"""The benchmarks' one harness: daemon processes, the HTTP client and the load generator's driver, CPU from ``/proc``, percentiles.

Every benchmark starts its servers, reads their CPU and drives load through
these pieces (public names only: no benchmark imports another's private
helpers):

- :class:`Daemon`: a server subprocess logging to a file, waited on by the lines it logs;
  :func:`start_relay` starts the usual relay (mock backend, Edge, Node) and waits for the
  Node to register; :func:`start_edge_and_node`, the Edge and the Node alone.
- :class:`HttpConnection`: one keep-alive HTTP/1.1 client connection; requests encoded by
  :mod:`iop_http`, answers parsed once by :class:`iop_http.AnswerParser`.
- :class:`LoadGenerator`: the :mod:`benchmarks.loadgen` process (closed-loop ``measure``
  and ``fleet`` commands), so its CPU stays out of the processes measured.
- :func:`cpu_seconds`, :func:`rss_mb`, :func:`runqueue_seconds`: a process's figures from ``/proc``.
- :func:`percentile`, :func:`load_average`, :func:`replace_doc_block` (the generated tables
  of ``docs/benchmarks.md``).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any, final

import attrs
import trio

from iop_http import AnswerError, AnswerParser, encode_request

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = pathlib.Path(__file__).parent / "results"
DOC = ROOT / "docs" / "benchmarks.md"
READY_TIMEOUT = 30.0
"""Seconds a daemon has to log a line waited for (or a condition waited for to hold)."""
DURATION = 2.0
"""Default measurement window of a closed-loop command, in seconds."""
WARMUP = 0.5
"""Default warm-up before it."""


# ------------------------------------------------------------------ the HTTP client


class ProtocolViolation(Exception):
    """The server's answer is not HTTP/1.1 this client understands."""


BodySink = Callable[[bytes], object]
"""Called with each piece of an answer's body as it is parsed (at the time of the read it came in)."""


@final
class HttpConnection:
    """One keep-alive HTTP/1.1 connection to a loopback server (reconnects when closed).

    Requests are encoded by :func:`iop_http.encode_request`; answers are parsed once, by
    :class:`iop_http.AnswerParser` (llhttp, in C, as the Node parses its upstream answers):
    no second reading of the head or the chunk framing in Python.
    """

    __slots__ = ("host", "port", "_stream", "headers", "opened")

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._stream: trio.SocketStream | None = None
        self.headers: dict[bytes, bytes] = {}
        """The headers of the last answer, names lower-cased (for those ``request`` does not return)."""
        self.opened = 0
        """Connections opened so far (a keep-alive client opens one)."""

    @staticmethod
    def build(
        method: str,
        path: str,
        body: bytes | None = None,
        host: str = "127.0.0.1",
        headers: dict[str, str] | None = None,
    ) -> bytes:
        """The request bytes for ``method path`` with an optional JSON body (encoded by :mod:`iop_http`)."""
        fields = [(b"host", host.encode())]
        if body is not None:
            fields.append((b"content-type", b"application/json"))
        fields += [(name.encode(), value.encode()) for name, value in (headers or {}).items()]
        if body is not None and not body:
            fields.append((b"content-length", b"0"))
        return encode_request(method.encode(), path.encode(), fields, body or b"")

    async def connect(self) -> None:
        """Open the connection now (``request`` opens it when needed otherwise). Checkpoints."""
        if self._stream is None:
            self._stream = await trio.open_tcp_stream(self.host, self.port)
            self.opened += 1

    async def request(self, raw: bytes, on_body: BodySink | None = None) -> tuple[int, bytes]:
        """Send prebuilt request bytes; return ``(status, body)``. Checkpoints.

        With ``on_body``, the body bytes of each read go to it as they arrive instead
        (the returned body is then empty). Cancellation leaves the connection
        unusable; it is closed and reopened by the next call.

        Raises:
            ProtocolViolation: the answer is malformed or cut short.
        """
        await self.connect()
        stream = self._stream
        assert stream is not None
        answer = AnswerParser()
        parts: list[bytes] = []
        try:
            await stream.send_all(raw)
            while not answer.complete:
                data = await stream.receive_some(65536)
                if data:
                    answer.feed(data)
                else:
                    answer.feed_eof()
                if (chunk := answer.take()) is not None:
                    if on_body is None:
                        parts.append(chunk)
                    else:
                        on_body(chunk)
        except AnswerError as exc:
            await self.aclose()
            raise ProtocolViolation(str(exc)) from None
        except BaseException:
            await self.aclose()
            raise
        self.headers = {name.lower(): value for name, value in answer.headers}
        if not answer.reusable:
            await self.aclose()
        return answer.status, b"".join(parts)

    async def aclose(self) -> None:
        """Close the socket (if open). Checkpoints."""
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.aclose()


def percentile(sorted_values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1, nearest rank) of ``sorted_values`` (sorted ascending); NaN when empty."""
    if not sorted_values:
        return math.nan
    index = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[index]


# ------------------------------------------------------------------ processes


class BenchmarkFailed(Exception):
    """A server did not start or a measurement could not be taken."""


# ------------------------------------------------------------------ processes


class Daemon:
    """A server subprocess whose stderr goes to a log file (read for its ports)."""

    def __init__(self, name: str, argv: list[str], workdir: pathlib.Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log = workdir / f"{name}.log"
        self._log_file = self.log.open("wb")
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            cwd=workdir,
        )

    def tail(self, lines: int = 15) -> str:
        text = self.log.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise BenchmarkFailed(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")

    async def wait_for_line(self, pattern: str) -> re.Match[str]:
        """Wait until the log has a line matching ``pattern``. Checkpoints."""
        regex = re.compile(pattern)
        with trio.move_on_after(READY_TIMEOUT):
            while True:
                match = regex.search(self.log.read_text(errors="replace"))
                if match:
                    return match
                self.check_alive()
                await trio.sleep(0.05)
        raise BenchmarkFailed(f"{self.name}: no line /{pattern}/ after {READY_TIMEOUT:.0f}s:\n{self.tail()}")

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the process has used so far; 0.0 without ``/proc``."""
        return cpu_seconds(self.proc.pid)

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def stop(self, timeout: float = 5.0) -> None:
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log_file.close()


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) process ``pid`` has used so far (``/proc``); 0.0 without."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def python_command(*args: str) -> list[str]:
    """The argv running this Python with ``args`` (``-m module ...``)."""
    return [sys.executable, *args]


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` in MiB (``/proc``); 0.0 without."""
    try:
        lines = pathlib.Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return 0.0
    for line in lines:
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def runqueue_seconds(pid: int) -> float:
    """Time the process's main thread has spent runnable but waiting for a CPU (``/proc``'s schedstat); 0.0 without."""
    try:
        with open(f"/proc/{pid}/schedstat") as stat:
            return int(stat.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


async def get_json(connection: HttpConnection, path: str) -> Any:
    status, body = await connection.request(HttpConnection.build("GET", path))
    if status != 200:
        raise BenchmarkFailed(f"GET {path}: {status} {body[:200]!r}")
    return json.loads(body)


def node_connected(status: dict[str, Any], node_id: str) -> bool:
    return any(n["node_id"] == node_id and n["connected"] for n in status["nodes"])


async def wait_until(what: str, check: Callable[[], Any], *daemons: Daemon) -> None:
    with trio.move_on_after(READY_TIMEOUT):
        while not await check():
            for daemon in daemons:
                daemon.check_alive()
            await trio.sleep(0.005)
        return
    raise BenchmarkFailed(f"timed out waiting for {what}")


class LoadGenerator:
    """The :mod:`benchmarks.loadgen` process: one JSON command in, one JSON result out."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            python_command("-m", "benchmarks.loadgen"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
            text=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu_seconds(self) -> float:
        """CPU time the load generator has used so far; 0.0 without ``/proc``."""
        return cpu_seconds(self.proc.pid)

    async def measure(self, **command: Any) -> dict[str, Any]:
        """One closed-loop measurement (:func:`benchmarks.loadgen.measure`'s arguments; ``duration`` and
        ``warmup`` default to :data:`DURATION` and :data:`WARMUP`). Checkpoints."""
        return await self._run({"duration": DURATION, "warmup": WARMUP, **command})

    async def fleet(self, **command: Any) -> dict[str, Any]:
        """Hold a fleet of streams (:func:`benchmarks.loadgen.fleet`'s arguments). Checkpoints."""
        return await self._run({"kind": "fleet", **command})

    async def _run(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        line = await trio.to_thread.run_sync(self.proc.stdout.readline)
        if not line:
            raise BenchmarkFailed(f"load generator exited with {self.proc.wait()}")
        result: dict[str, Any] = json.loads(line)
        if "failed" in result:
            raise BenchmarkFailed(f"load generator: {result['failed']} ({command.get('port')})")
        return result

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@attrs.frozen
class Relay:
    """The processes of a relay benchmark: the mock backend, an Edge and a Node registered to it."""

    backend: Daemon
    edge: Daemon
    node: Daemon
    backend_port: int
    http_port: int
    node_port: int


async def start_relay(
    workdir: pathlib.Path, daemons: list[Daemon], *, mock_args: list[str], edge_yaml: str, node_yaml: str
) -> Relay:
    """Start ``iop-mock-backend`` (with ``mock_args``), an Edge and a ``bench-node`` Node; return once it registered.

    ``node_yaml`` is formatted with ``node_port`` and ``backend_port``. Every
    process started is appended to ``daemons`` at once (the caller stops them).
    """
    backend = Daemon("mock-backend", python_command("-m", "iop_mock", "--port", "0", *mock_args), workdir)
    daemons.append(backend)
    backend_port = int((await backend.wait_for_line(r"listening on http://[^:]+:(\d+)")).group(1))
    edge, node, http_port, node_port = await start_edge_and_node(
        workdir, daemons, edge_yaml=edge_yaml, node_yaml=node_yaml, backend_port=backend_port
    )
    return Relay(backend, edge, node, backend_port, http_port, node_port)


async def start_edge_and_node(
    workdir: pathlib.Path, daemons: list[Daemon], *, edge_yaml: str, node_yaml: str, **ports: int
) -> tuple[Daemon, Daemon, int, int]:
    """Start an Edge and a Node (``bench-node``); return ``(edge, node, http_port, node_port)`` once it registered.

    ``node_yaml`` is formatted with ``node_port`` (the Edge's node socket) and ``ports``.
    Each process started is appended to ``daemons`` at once (the caller stops them).
    """
    (workdir / "edge.yaml").write_text(edge_yaml)
    edge = Daemon("edge", python_command("-m", "iop_edge", "--config", str(workdir / "edge.yaml")), workdir)
    daemons.append(edge)
    match = await edge.wait_for_line(r"listening: http://[^:]+:(\d+) \(API\), ws://[^:]+:(\d+)")
    http_port, node_port = int(match.group(1)), int(match.group(2))
    (workdir / "bench-node.yaml").write_text(node_yaml.format(node_port=node_port, **ports))
    node = Daemon("bench-node", python_command("-m", "iop_node", "--config", str(workdir / "bench-node.yaml")), workdir)
    daemons.append(node)
    poller = HttpConnection("127.0.0.1", http_port)

    async def bench_node_up() -> bool:
        return node_connected(await get_json(poller, "/status"), "bench-node")

    await wait_until("bench-node to register", bench_node_up, node, edge)
    await poller.aclose()
    return edge, node, http_port, node_port


def run_suite(
    prefix: str, main: Callable[..., Awaitable[dict[str, Any]]], *args: Any, with_peers: bool
) -> dict[str, Any]:
    """``trio.run(main, *args, workdir)`` in a new temporary ``workdir`` (kept, and named, if the run fails),
    its result stamped with the command, the time and the box's load average at the end."""
    workdir = pathlib.Path(tempfile.mkdtemp(prefix=prefix))
    try:
        result = trio.run(main, *args, workdir)
    except BenchmarkFailed:
        print(f"(logs kept in {workdir})", file=sys.stderr)
        raise
    shutil.rmtree(workdir, ignore_errors=True)
    result["command"] = "make bench-peers" if with_peers else "make bench"
    result["when"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result["load_average"] = load_average()
    RESULTS.mkdir(exist_ok=True)
    return result


def load_average() -> str:
    """The box's 1/5/15-minute load averages, for the report (a shared box says so here)."""
    try:
        return " / ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def replace_doc_block(begin: str, end: str, block: str) -> None:
    """Replace the text from ``begin`` to ``end`` in ``docs/benchmarks.md`` with ``block`` (if both are there)."""
    if not DOC.exists():
        return
    text = DOC.read_text()
    if begin not in text or end not in text:
        return
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    DOC.write_text(head + block + tail)
