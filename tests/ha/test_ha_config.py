"""[ha-election] The ``ha:`` section of ``edge.yaml``: defaults, and each rule's error."""

from __future__ import annotations

from pathlib import Path

import pytest

from iop_config import ConfigFileError
from iop_edge.config import EdgeConfig, load_edge_config
from iop_node import load_node_config

pytestmark = pytest.mark.req("ha-election")

BASE = """\
nodes:
  - id: node-a
    token: t
    providers: [{id: gpu0, capacity: 1}]
models:
  - id: m
    candidates: [{node: node-a, provider: gpu0}]
"""


def load(tmp_path: Path, ha: str) -> EdgeConfig:
    path = tmp_path / "edge.yaml"
    path.write_text(BASE + ha)
    return load_edge_config(path)


def test_without_ha_there_is_no_election(tmp_path: Path) -> None:
    assert load(tmp_path, "").ha is None


def test_the_defaults(tmp_path: Path) -> None:
    ha = load(tmp_path, "ha: {endpoints: ['http://127.0.0.1:2379'], advertise: edge-a}\n").ha
    assert ha is not None
    assert (ha.election, ha.ttl_s, ha.margin, ha.poll_interval_ms, ha.key) == (
        "iop-edge",
        2,
        2 / 3,
        100,
        "/iop/election/iop-edge",
    )


@pytest.mark.parametrize(
    ("ha", "field"),
    [
        ("{endpoints: [], advertise: a}", "ha.endpoints"),
        ("{endpoints: ['127.0.0.1:2379'], advertise: a}", "ha.endpoints[0]"),
        ("{endpoints: ['http://e:2379'], advertise: ''}", "ha.advertise"),
        ("{endpoints: ['http://e:2379'], advertise: a, ttl_s: 1}", "ha.ttl_s"),
        ("{endpoints: ['http://e:2379'], advertise: a, step_down_margin_ms: 2000}", "ha.step_down_margin_ms"),
        ("{endpoints: ['http://e:2379'], advertise: a, poll_interval_ms: 1}", "ha.poll_interval_ms"),
        ("{endpoints: ['http://e:2379'], advertise: a, cert_file: c.pem}", "ha.cert_file"),
        ("{endpoints: ['http://e:2379'], advertise: a, user: iop}", "ha"),
        ("{endpoints: ['http://e:2379'], advertise: a, password: p}", "ha.user"),
        ("{endpoints: ['http://e:2379'], advertise: a, user: '', password: p}", "ha.user"),
        ("{endpoints: ['http://e:2379'], advertise: a, user: iop, password: p, password_env: E}", "ha.password_env"),
        ("{endpoints: ['http://e:2379'], advertise: a, user: iop, password_env: IOP_UNSET_ETCD_PW}", "ha.password_env"),
    ],
)
def test_each_rule_names_its_field(tmp_path: Path, ha: str, field: str) -> None:
    with pytest.raises(ConfigFileError) as info:
        load(tmp_path, f"ha: {ha}\n")
    assert any(field + ":" in error for error in info.value.errors), info.value.errors


def test_the_etcd_password_comes_from_the_environment_and_is_never_shown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IOP_ETCD_PASSWORD", "s3cret")
    ha = load(
        tmp_path, "ha: {endpoints: ['http://e:2379'], advertise: a, user: iop, password_env: IOP_ETCD_PASSWORD}\n"
    ).ha
    assert ha is not None and ha.credentials == ("iop", "s3cret")
    assert "s3cret" not in repr(ha)
    assert load(tmp_path, "ha: {endpoints: ['http://e:2379'], advertise: a}\n").ha.credentials is None  # type: ignore[union-attr]


def test_the_deployment_example_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """deploy/ha/edge.yaml, the HA example docs/ha.md points at, is a valid config with ``ha:``."""
    monkeypatch.setenv("IOP_NODE_A_TOKEN", "t")
    config = load_edge_config(Path(__file__).resolve().parents[2] / "deploy" / "ha" / "edge.yaml")
    assert config.ha is not None
    assert len(config.ha.endpoints) == 3


@pytest.mark.req("warm-standby")
def test_the_deployment_example_node_lists_both_edges(monkeypatch: pytest.MonkeyPatch) -> None:
    """deploy/ha/node.yaml: a Node registered with both Edges of the example."""
    monkeypatch.setenv("IOP_NODE_A_TOKEN", "t")
    config = load_node_config(Path(__file__).resolve().parents[2] / "deploy" / "ha" / "node.yaml")
    assert len(config.urls) == 2
