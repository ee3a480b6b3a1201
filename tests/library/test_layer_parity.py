"""One library on two layers: ``Admission`` (trio) and ``AsyncAdmission`` (asyncio) have the
same public calls, compared by introspection, and each names the other when used under the
wrong runtime.

The differences the surfaces may keep are :data:`ALLOWED`, each with its reason; the same
list is the table "One library on two layers" of docs/admission.md.
"""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path
from typing import Any

import pytest
import trio

from iop_admission import Admission, ModelGroup, PoolConfig, ProviderKey, ProviderSpec
from iop_admission.aio import AsyncAdmission

GPU0 = ProviderKey("local", "gpu0")
CONFIG = PoolConfig(providers={GPU0: ProviderSpec(capacity=1)}, models={"m": ModelGroup([GPU0])})
DOC = Path(__file__).resolve().parents[2] / "docs" / "admission.md"

ALLOWED: dict[str, str] = {
    "lease": "returns the layer's own scope: LeaseScope (trio) or AsyncLeaseScope (asyncio)",
    "retry": "returns the layer's own scope: LeaseScope (trio) or AsyncLeaseScope (asyncio)",
    "subscribe": "yields the runtime's own stream: a trio MemoryReceiveChannel or an async iterator",
}
"""Calls whose return annotation differs between the layers (names and parameters never do)."""


def _public(cls: type) -> dict[str, Any]:
    return {name: member for name, member in inspect.getmembers(cls) if not name.startswith("_")}


def _shape(member: Any, name: str) -> tuple[str, ...]:
    """What a caller sees of a public member: its kind, parameters, and (unless allowed to
    differ) its return annotation."""
    if isinstance(member, property):
        return ("property", str(inspect.signature(member.fget).return_annotation))
    function = inspect.unwrap(member)
    signature = inspect.signature(function)
    params = tuple(f"{p.kind.name} {p.name}: {p.annotation} = {p.default!r}" for p in signature.parameters.values())
    kind = "async" if inspect.iscoroutinefunction(function) else "sync"
    returns = "(allowed to differ)" if name in ALLOWED else str(signature.return_annotation)
    return (kind, *params, returns)


@pytest.mark.req("layer-parity")
def test_both_layers_have_the_same_public_calls_with_the_same_parameters() -> None:
    trio_side, asyncio_side = _public(Admission), _public(AsyncAdmission)
    assert sorted(trio_side) == sorted(asyncio_side)
    for name in trio_side:
        assert _shape(trio_side[name], name) == _shape(asyncio_side[name], name), name


@pytest.mark.req("layer-parity")
def test_the_allowed_differences_are_the_documented_ones() -> None:
    """Every allowed difference is a row of the table in docs/admission.md."""
    text = DOC.read_text(encoding="utf-8")
    table = text[text.index("## One library on two layers") :]
    for name in ALLOWED:
        assert f"`{name}`" in table, name


async def _misused(admission: Any, calls: str) -> None:
    """``lease``, ``subscribe`` and ``watch_ejections`` of ``admission`` under the other runtime:
    each raises a RuntimeError whose message matches ``calls`` (with the call's name in it),
    and nothing changes; the synchronous calls work under any runtime."""
    admission.connect("local")
    assert admission.snapshot().providers[0].connected
    with pytest.raises(RuntimeError, match=calls.format(call="lease")):
        async with admission.lease("m"):
            pass
    with pytest.raises(RuntimeError, match=calls.format(call="subscribe")):
        async with admission.subscribe():
            pass
    with pytest.raises(RuntimeError, match=calls.format(call="watch_ejections")):
        await admission.watch_ejections()
    assert admission.queue_depth == 0 and admission.snapshot().providers[0].in_flight == 0


@pytest.mark.req("layer-parity")
def test_the_asyncio_layer_under_trio_names_the_trio_layer() -> None:
    calls = r"^AsyncAdmission\.{call}\(\) runs under asyncio only; under trio use iop_admission\.Admission$"
    trio.run(_misused, AsyncAdmission(CONFIG), calls)


@pytest.mark.req("layer-parity")
def test_the_trio_layer_under_asyncio_names_the_asyncio_layer() -> None:
    calls = r"^Admission\.{call}\(\) runs under trio only; under asyncio use iop_admission\.aio\.AsyncAdmission$"
    asyncio.run(_misused(Admission(CONFIG), calls))


@pytest.mark.req("layer-parity")
def test_the_asyncio_layer_outside_any_loop_says_it_needs_one() -> None:
    admission = AsyncAdmission(CONFIG)
    admission.connect("local")
    scope = admission.lease("m")
    with pytest.raises(
        RuntimeError, match=r"needs a running asyncio event loop: call it from a task of asyncio\.run\(\)"
    ):
        scope.__aenter__().send(None)
    assert admission.provider_rows()[0]["in_flight"] == 0 and admission.waiters() == ()
