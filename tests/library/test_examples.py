"""The runnable examples under ``examples/`` do what their docstrings say."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType

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
