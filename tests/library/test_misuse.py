"""Misuse of the public API raises named errors that say what to write instead."""

from __future__ import annotations

import asyncio

import pytest
import trio

from iop_admission import (
    Admission,
    ConfigError,
    ModelGroup,
    NodeNotFound,
    PoolConfig,
    ProviderKey,
    ProviderSpec,
    Unavailable,
)

GPU0 = ProviderKey("node-a", "gpu0")


def test_model_group_of_a_string_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"not a string \('node-a/gpu0'\).*ProviderKey\(node_id, provider_id\)"):
        ModelGroup("node-a/gpu0")  # type: ignore[arg-type]


def test_model_group_of_a_tuple_candidate_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"candidate \('node-a', 'gpu0'\) is a tuple, not a ProviderKey"):
        ModelGroup([("node-a", "gpu0")])  # type: ignore[list-item]


def test_model_group_keeps_its_candidates_in_order() -> None:
    assert ModelGroup([GPU0, ProviderKey("node-b", "gpu1")]).candidates[0] == GPU0


def test_unavailable_says_why_for_each_candidate() -> None:
    gpu1 = ProviderKey("node-b", "gpu1")
    gpu2 = ProviderKey("node-b", "gpu2")
    config = PoolConfig(
        providers={
            GPU0: ProviderSpec(capacity=1),
            gpu1: ProviderSpec(capacity=1, enabled=False),
            gpu2: ProviderSpec(1),
        },
        models={"m": ModelGroup([GPU0, gpu1, gpu2])},
    )

    async def main() -> None:
        admission = Admission(config)
        admission.connect("node-b")
        with pytest.raises(Unavailable) as caught:
            async with admission.lease("m", long=True):
                pass
        assert caught.value.reasons == (
            "node-a/gpu0: node 'node-a' is not connected (call connect('node-a'))",
            "node-b/gpu1: disabled (enabled=False)",
            "node-b/gpu2: runs no long requests (long_context_capacity=0)",
        )
        assert str(caught.value).startswith("no eligible provider for long request on model 'm'; node-a/gpu0: ")

    trio.run(main)


def test_connect_of_a_node_without_providers_is_an_error() -> None:
    admission = Admission(PoolConfig(providers={GPU0: ProviderSpec(capacity=1)}, models={"m": ModelGroup([GPU0])}))
    with pytest.raises(
        NodeNotFound, match=r"node 'typo-node' has no configured provider; nodes with providers: 'node-a'"
    ):
        admission.connect("typo-node")
    assert admission.generation("typo-node") == 0
    assert admission.connect("node-a") == 1


def test_trio_lease_under_asyncio_names_the_asyncio_layer() -> None:
    admission = Admission(PoolConfig(providers={GPU0: ProviderSpec(capacity=1)}, models={"m": ModelGroup([GPU0])}))

    async def main() -> None:
        async with admission.lease("m"):
            pass

    with pytest.raises(RuntimeError, match=r"under asyncio use iop_admission\.aio\.AsyncAdmission"):
        asyncio.run(main())


def test_a_negative_capacity_is_one_problem_not_two() -> None:
    with pytest.raises(ConfigError) as caught:
        ProviderSpec(capacity=-1)
    assert caught.value.problems == ("provider.capacity: must be >= 1, got -1",)
