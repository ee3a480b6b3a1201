"""``iop_admission.testing`` finds what it promises to find, passes what is correct, and stays optional.

The planted leak is the one issue 42 describes: a service's wrapper that
leaks one long lease in seven (it hands the lease's exit away and forgets it).
A hand-written harness let it through 300 examples; the module must find it
within its default budget, Hypothesis's 100 examples, on both layers. The
search runs without the shrink phase here (the search is what is under test,
and shrinking takes several times longer); ``derandomize`` keeps the run the
same on every machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import trio
from hypothesis import Phase, given, settings
from hypothesis.errors import FlakyFailure
from tests.admission.layers import books_closed

from iop_admission import Admission, Lease, ProviderKey
from iop_admission.aio import AsyncAdmission
from iop_admission.testing import Ask, Client, Finish, Step, lease_directly, programs, run_program

ROOT = Path(__file__).resolve().parents[2]


def _example() -> ModuleType:
    """``examples/testing_guard.py``, whose ``Guard`` is the control: a correct wrapper."""
    spec = importlib.util.spec_from_file_location("testing_guard", ROOT / "examples" / "testing_guard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["testing_guard"] = module  # registered, as an import would
    spec.loader.exec_module(module)
    return module


testing_guard = _example()
CONFIG = testing_guard.CONFIG
LAYERS = ["trio", "asyncio"]


class LeakyGuard:
    """A wrapper with the bug of issue 42: every seventh long lease is never released.

    It means to hand the lease's exit to a streaming response (``pop_all``) and
    then forgets it; nothing fails, the long slot is simply gone.
    """

    def __init__(self, admission: Admission | AsyncAdmission) -> None:
        self.admission = admission
        self.long_leases = 0

    @contextlib.asynccontextmanager
    async def run(self, model: str, *, long: bool = False, tenant: str | None = None) -> AsyncIterator[Lease]:
        async with contextlib.AsyncExitStack() as stack:
            lease = await stack.enter_async_context(self.admission.lease(model, long=long, tenant=tenant))
            self.long_leases += long
            if long and self.long_leases % 7 == 0:
                stack.pop_all()
            yield lease


def leaky_client(admission: Admission | AsyncAdmission) -> Client:
    guard = LeakyGuard(admission)
    return lambda ask: guard.run(ask.model, long=ask.long, tenant=ask.tenant)


def _search(layer: str, client: Callable[[Any], Client], runs: list[int]) -> None:
    """Hypothesis's default budget of 100 programs over ``CONFIG``; ``runs`` counts the programs run."""

    @settings(max_examples=100, deadline=None, derandomize=True, database=None, phases=(Phase.generate,))
    @given(program=programs(CONFIG))
    def search(program: list[Step]) -> None:
        runs.append(1)
        run_program(program, CONFIG, layer=layer, client=client)

    search()


def _found(layer: str, client: Callable[[Any], Client]) -> str:
    """What the search reports about ``client``, having found it broken within the budget.

    Trio runs a step's woken tasks in an order of its own choosing, so a fault
    that depends on that order (which lease is the seventh) may not repeat when
    Hypothesis replays the program: then it reports the failure as flaky, with
    the same message inside.
    """
    runs: list[int] = []
    try:
        _search(layer, client, runs)
    except AssertionError as exc:
        message = str(exc)
    except FlakyFailure as group:
        message = "\n".join(str(exc) for exc in group.exceptions)
    else:
        raise AssertionError(f"not found in {len(runs)} programs")
    assert len(runs) <= 100
    return message


@pytest.mark.parametrize("layer", LAYERS)
def test_a_long_lease_leaked_once_in_seven_is_found_within_the_default_budget(layer: str) -> None:
    # Its symptoms: the lease outlives its call; or, revoked first, it cancels its task (asyncio) or its
    # scope left open ends its task with trio's error.
    symptom = r"a lease outlived its call \(leaked\)|scope was never exited|never exited\)"
    assert re.search(symptom, _found(layer, leaky_client))


@pytest.mark.parametrize("layer", LAYERS)
def test_the_correct_wrapper_keeps_every_promise_for_the_whole_budget(layer: str) -> None:
    runs: list[int] = []
    _search(layer, testing_guard.guard_client, runs)
    assert len(runs) == 100


@pytest.mark.parametrize("layer", LAYERS)
@settings(max_examples=30, deadline=None)
@given(program=programs(CONFIG))
def test_the_layers_own_tables_are_empty_after_every_program(layer: str, program: list[Step]) -> None:
    """Our own suite's use: the lease taken directly, and each layer's private maps checked at the end."""
    run_program(program, CONFIG, layer=layer, client=lease_directly, check=books_closed)


class PollsForRoom:
    """A wrapper that looks for room itself and polls instead of queueing: a call that comes
    after a slot freed takes it before the calls already polling (FIFO broken)."""

    def __init__(self, admission: Admission | AsyncAdmission) -> None:
        self.admission = admission

    def _room(self, model: str) -> bool:
        candidates = self.admission.config.models[model].candidates
        rows = {ProviderKey(p.node_id, p.provider_id): p for p in self.admission.snapshot().providers}
        return any(rows[k].in_flight < rows[k].effective_capacity for k in candidates if k in rows)

    @contextlib.asynccontextmanager
    async def run(self, ask: Ask) -> AsyncIterator[Lease]:
        while ask.model in self.admission.config.models and not self._room(ask.model):
            if isinstance(self.admission, AsyncAdmission):
                await asyncio.sleep(1)
            else:
                await trio.sleep(1)
        async with self.admission.lease(ask.model, long=ask.long, tenant=ask.tenant) as lease:
            yield lease


@pytest.mark.parametrize("layer", LAYERS)
def test_a_wrapper_that_polls_instead_of_queueing_is_found_to_break_fifo(layer: str) -> None:
    message = _found(layer, lambda admission: PollsForRoom(admission).run)
    assert re.search(r"entered while the earlier .* still waits \(FIFO within a tenant\)", message)


class ExitsTwice:
    """A wrapper that releases by hand after the scope already did: a misuse the library refuses."""

    def __init__(self, admission: Admission | AsyncAdmission) -> None:
        self.admission = admission

    @contextlib.asynccontextmanager
    async def run(self, ask: Ask) -> AsyncIterator[Lease]:
        scope = self.admission.lease(ask.model, long=ask.long, tenant=ask.tenant)
        async with scope as lease:
            yield lease
        await scope.__aexit__(None, None, None)


@pytest.mark.parametrize("layer", LAYERS)
def test_a_misuse_error_out_of_a_call_is_reported_with_its_call(layer: str) -> None:
    program: list[Step] = [Ask("chat", tenant="paid"), Finish(0)]
    with pytest.raises(AssertionError, match=r"after step 2, Finish.*call #1 \('chat'.*raised LeaseScopeError"):
        run_program(program, CONFIG, layer=layer, client=lambda admission: ExitsTwice(admission).run)


class HangsAfterRelease:
    """A wrapper whose exit waits for something that never comes, after the lease went back."""

    def __init__(self, admission: Admission | AsyncAdmission) -> None:
        self.admission = admission

    @contextlib.asynccontextmanager
    async def run(self, ask: Ask) -> AsyncIterator[Lease]:
        async with self.admission.lease(ask.model, long=ask.long, tenant=ask.tenant) as lease:
            yield lease
        if isinstance(self.admission, AsyncAdmission):
            await asyncio.Event().wait()
        else:
            await trio.sleep_forever()


@pytest.mark.parametrize("layer", LAYERS)
def test_a_call_that_never_ends_is_reported_and_the_run_still_ends(layer: str) -> None:
    with pytest.raises(AssertionError, match=r"^at the end: never ended: call #1 \('chat'"):
        run_program(
            [Ask("chat", hold=False)], CONFIG, layer=layer, client=lambda admission: HangsAfterRelease(admission).run
        )


def test_the_code_of_the_testing_page_is_the_examples() -> None:
    """Each ``python`` block of docs/testing.md is a piece of examples/testing_guard.py, which runs."""
    page = (ROOT / "docs" / "testing.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```$", page, re.M | re.S)
    example = (ROOT / "examples" / "testing_guard.py").read_text(encoding="utf-8")
    assert len(blocks) == 3
    assert [block in example for block in blocks] == [True, True, True]


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)


def test_importing_the_library_imports_no_hypothesis() -> None:
    done = _python(
        "import sys, iop_admission, iop_admission.aio, iop_admission.core\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'hypothesis'))"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[]\n"


def test_the_testing_module_without_hypothesis_says_what_to_install() -> None:
    done = _python("import sys; sys.modules['hypothesis'] = None; import iop_admission.testing")
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        'ImportError: iop_admission.testing needs Hypothesis: pip install "iop-admission[testing]"'
    )


def test_the_example_runs_as_a_script(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "testing_guard.py")], capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == "Guard kept every promise on trio and asyncio (100 programs each)\n"
