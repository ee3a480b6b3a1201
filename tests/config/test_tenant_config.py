"""``tenants:`` in edge.yaml ([tenant-edge]): the keys, their rules with file:line, the pool's specs, the key map."""

from __future__ import annotations

import pathlib
import textwrap

import pytest

from iop_admission import TenantSpec
from iop_config import ConfigFileError
from iop_edge.config import EdgeConfig, load_edge_config

BASE = """\
nodes:
  - id: node-a
    token: dev-token
    providers: [{id: gpu0, capacity: 4}]
models:
  - id: m
    candidates: [{node: node-a, provider: gpu0}]
"""

TENANTS = """\
tenant_cost: tokens
tenants:
  - name: chat
    weight: 2
    priority: 1
    max_in_flight: 3
    max_queue: 10
    api_keys: [chat-key-1, chat-key-2]
  - name: batch
    priority: -1
    api_keys_env: IOP_TEST_BATCH_KEYS
  - {name: eval, weight: 0.5}
"""


@pytest.fixture(autouse=True)
def in_tmp(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("IOP_TEST_BATCH_KEYS", "batch-a, batch-b,")


def load(text: str) -> EdgeConfig:
    pathlib.Path("edge.yaml").write_text(textwrap.dedent(text), encoding="utf-8")
    return load_edge_config("edge.yaml")


def errors_of(text: str) -> tuple[str, ...]:
    with pytest.raises(ConfigFileError) as info:
        load(text)
    return info.value.errors


@pytest.mark.req("tenant-edge")
def test_no_tenants_is_today() -> None:
    config = load(BASE)
    assert config.tenants == ()
    assert config.tenant_cost == "requests"
    assert config.tenant_header is None
    assert config.pool_config().tenants == ()
    assert not config.api_keys_required
    assert config.tenant_of("any-key") is None
    assert config.tenant_of(None, "chat") is None


@pytest.mark.req("tenant-edge")
def test_tenants_map_to_the_pool_and_their_keys() -> None:
    config = load(TENANTS + BASE)
    assert config.pool_config().tenants == (
        TenantSpec("chat", weight=2.0, priority=1, max_in_flight=3, max_queue=10),
        TenantSpec("batch", weight=1.0, priority=-1),
        TenantSpec("eval", weight=0.5),
    )
    assert config.tenant_cost == "tokens"
    assert config.api_keys_required  # a tenant's keys are API keys
    for key, tenant in [("chat-key-1", "chat"), ("chat-key-2", "chat"), ("batch-a", "batch"), ("batch-b", "batch")]:
        assert config.accepts_api_key(key)
        assert config.tenant_of(key) == tenant
    assert not config.accepts_api_key("nobody")
    assert config.tenant_of("nobody") is None
    assert "chat-key-1" not in repr(config)


@pytest.mark.req("tenant-edge")
def test_top_level_keys_belong_to_the_default_tenant() -> None:
    config = load("api_keys: [plain]\n" + TENANTS + BASE)
    assert config.accepts_api_key("plain")
    assert config.accepts_api_key("chat-key-1")
    assert config.tenant_of("plain") is None


@pytest.mark.req("tenant-edge")
def test_the_tenant_header_is_read_only_when_turned_on() -> None:
    off = load(TENANTS + BASE)
    assert off.tenant_of("batch-a", "chat") == "batch"
    assert off.tenant_of(None, "chat") is None
    on = load("tenant_header: x-iop-tenant\n" + TENANTS + BASE)
    assert on.tenant_header == "x-iop-tenant"
    assert on.tenant_of("batch-a", "chat") == "chat"  # the trusted proxy's name wins
    assert on.tenant_of(None, None) is None


@pytest.mark.req("tenant-edge")
def test_tenant_rules_report_file_line_and_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IOP_TEST_DUP", "chat-key-2")
    text = (
        """\
tenant_cost: bytes
tenant_header: "bad header"
tenants:
  - name: ""
    weight: 0
    max_in_flight: 0
  - name: a
    api_keys: []
  - name: a
    max_queue: 0
    api_keys: [x]
    api_keys_env: IOP_TEST_BATCH_KEYS
  - name: b
    api_keys_env: IOP_TEST_UNSET
  - name: c
    api_keys: [chat-key-2]
  - name: d
    api_keys_env: IOP_TEST_DUP
"""
        + BASE
    )
    assert errors_of(text) == (
        "edge.yaml:1: tenant_cost: must be one of requests, tokens",
        "edge.yaml:2: tenant_header: must be an HTTP header name (or leave the key out: off)",
        "edge.yaml:4: tenants[0].name: must not be empty",
        "edge.yaml:5: tenants[0].weight: must be > 0, got 0.0",
        "edge.yaml:6: tenants[0].max_in_flight: must be >= 1, got 0",
        "edge.yaml:8: tenants[1].api_keys: must list at least one key (leave the key out for a tenant without keys)",
        "edge.yaml:9: tenants[2].name: duplicate tenant 'a' (first at tenants[1])",
        "edge.yaml:10: tenants[2].max_queue: must be >= 1, got 0",
        "edge.yaml:12: tenants[2].api_keys_env: give at most one of api_keys or api_keys_env",
        "edge.yaml:14: tenants[3].api_keys_env: environment variable 'IOP_TEST_UNSET' is not set or holds no keys "
        "(expected a comma-separated list)",
        "edge.yaml:18: tenants[5].api_keys_env: a key of this tenant belongs to tenants[4] too",
    )


@pytest.mark.req("tenant-edge")
def test_unknown_tenant_keys_are_refused() -> None:
    assert errors_of("tenants: [{name: a, colour: red}]\n" + BASE) == (
        "edge.yaml:1: tenants[0].colour: unknown key 'colour'",
    )
