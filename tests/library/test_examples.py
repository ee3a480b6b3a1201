"""The runnable examples under ``examples/`` do what their docstrings say."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType

import attrs
import pytest
import trio
import trio.testing

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


async def test_trio_job_runner_shares_both_gpus(autojump_clock: trio.testing.MockClock) -> None:
    runner = _load("trio_job_runner")
    start = trio.current_time()
    done = await runner.run_jobs(10)
    assert sorted(job for job, _ in done) == list(range(10))
    # Four slots (two GPUs x 2): ten 0.1 s jobs finish in three rounds, on both GPUs.
    assert set(Counter(where for _, where in done)) == {"local/gpu0", "local/gpu1"}
    assert trio.current_time() - start == pytest.approx(0.3)


def test_fastapi_guard_serves_and_sheds() -> None:
    from fastapi.testclient import TestClient

    guard = _load("fastapi_guard")
    with TestClient(guard.create_app()) as client:
        assert client.get("/search", params={"q": "gpu"}).json() == {"result": "GPU"}
        admission = client.app.state.admission  # type: ignore[attr-defined]
        assert admission.queue_depth == 0
        assert sum(p.in_flight for p in client.portal.call(admission.snapshot).providers) == 0


def test_fastapi_guard_answers_503_when_the_queue_is_full() -> None:
    from fastapi.testclient import TestClient

    from iop_admission import PoolConfig, QueuePolicy

    guard = _load("fastapi_guard")
    no_queue: PoolConfig = attrs.evolve(guard.CONFIG, policy=QueuePolicy(max_queue=0))
    app = guard.create_app(no_queue)
    with TestClient(app) as client:
        admission = app.state.admission
        scope = admission.lease("search")
        client.portal.call(scope.__aenter__)  # one of the two slots
        client.portal.call(admission.lease("search").__aenter__)  # and the other
        answer = client.get("/search", params={"q": "x"})
        assert answer.status_code == 503
        assert answer.json() == {"detail": "busy, try again later"}


def test_mypy_strict_on_the_fastapi_example() -> None:
    """The trio example is checked in a clean venv (test_install.py); this one needs FastAPI."""
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", str(ROOT / "examples" / "fastapi_guard.py")],
        capture_output=True,
        text=True,
        cwd=ROOT / "examples",
    )
    assert done.returncode == 0, done.stdout + done.stderr
