"""node.yaml: the contract keys, defaults, and errors with file:line: path."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

import pytest
import trustme

from iop_config import ConfigFileError, load_config_text
from iop_node import NodeConfig, load_node_config

GOOD = """\
node_id: node-a
edge_url: ws://127.0.0.1:8081
token: dev-token
heartbeat_interval_ms: 5000
runtime: {concurrency: 4}
providers:
  - {id: gpu0, adapter: openai, base_url: "http://127.0.0.1:9100/v1", capacity: 1}
"""


def errors_of(text: str) -> tuple[str, ...]:
    with pytest.raises(ConfigFileError) as caught:
        load_config_text(text, NodeConfig, filename="node.yaml")
    return caught.value.errors


def test_the_contract_example_loads_with_defaults() -> None:
    config = load_config_text(GOOD, NodeConfig, filename="node.yaml")
    assert (config.node_id, config.runtime.concurrency, config.heartbeat_interval_ms) == ("node-a", 4, 5000)
    (provider,) = config.providers
    assert (provider.adapter, provider.capacity, provider.timeout_ms, provider.abort_grace_ms) == (
        "openai",
        1,
        300_000,
        1_000,
    )
    assert (config.reconnect.initial_ms, config.reconnect.max_ms, config.reconnect.jitter) == (100, 5000, 0.2)
    assert config.resolved_token() == "dev-token"
    assert "dev-token" not in repr(config)


def test_example_node_yaml_loads() -> None:
    """The Node config iop-stack ships as package data."""
    with importlib.resources.as_file(importlib.resources.files("iop_stack") / "examples" / "node.yaml") as path:
        assert load_node_config(path).providers[0].id == "gpu0"


def test_unknown_key_names_file_line_and_path() -> None:
    text = GOOD.replace("capacity: 1}", "capacity: 1, gpu: true}")
    assert errors_of(text) == ("node.yaml:7: providers[0].gpu: unknown key 'gpu'",)


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("capacity: 1}", "capacity: 0}", "node.yaml:7: providers[0].capacity: must be >= 1, got 0"),
        ("capacity: 1}", "capacity: lots}", "node.yaml:7: providers[0].capacity: "),
        ("adapter: openai", "adapter: vllm", "node.yaml:7: providers[0].adapter: must be one of openai, ollama, mock"),
        ('base_url: "http://127.0.0.1:9100/v1", ', "", "node.yaml:7: providers[0].base_url: is required"),
        ("{concurrency: 4}", "{concurrency: 0}", "node.yaml:5: runtime.concurrency: must be >= 1"),
        (
            "capacity: 1}",
            "capacity: 1, abort_grace_ms: 2000}",
            "node.yaml:7: providers[0].abort_grace_ms: must be 0 to 1500",
        ),
        (
            "capacity: 1}",
            "capacity: 1, abort_grace_ms: -1}",
            "node.yaml:7: providers[0].abort_grace_ms: must be 0 to 1500",
        ),
        ("ws://127.0.0.1:8081", "http://127.0.0.1:8081", "node.yaml:2: edge_url: must start with ws://"),
    ],
)
def test_bad_values(old: str, new: str, expected: str) -> None:
    errors = errors_of(GOOD.replace(old, new))
    assert any(error.startswith(expected) for error in errors), errors


def test_missing_token_is_an_error() -> None:
    assert errors_of(GOOD.replace("token: dev-token\n", "")) == (
        "node.yaml:1: token: missing: give token or token_env",
    )


def test_token_and_token_env_are_exclusive() -> None:
    errors = errors_of(GOOD.replace("token: dev-token\n", "token: a\ntoken_env: B\n"))
    assert errors == ("node.yaml:4: token_env: give either token or token_env, not both",)


def test_token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    text = GOOD.replace("token: dev-token", "token_env: IOP_TEST_TOKEN")
    monkeypatch.delenv("IOP_TEST_TOKEN", raising=False)
    assert errors_of(text) == ("node.yaml:3: token_env: environment variable 'IOP_TEST_TOKEN' is not set or empty",)
    monkeypatch.setenv("IOP_TEST_TOKEN", "from-env")
    assert load_config_text(text, NodeConfig).resolved_token() == "from-env"


def test_duplicate_provider_ids() -> None:
    text = GOOD + "  - {id: gpu0, adapter: mock}\n"
    assert errors_of(text) == ("node.yaml:8: providers[1].id: duplicate provider id 'gpu0'",)


@pytest.mark.req("tls")
def test_tls_settings_need_wss_and_readable_files(tmp_path: Path) -> None:
    """[tls] node tls: private CA and client certificate; needs wss://; cert and key together; a
    missing file names the file and the field at its line."""
    ca = trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    leaf = ca.issue_cert("node-a")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    wss = GOOD.replace("ws://", "wss://")
    config = load_config_text(
        wss + f"tls: {{ca_file: '{ca_file}', cert_file: '{cert}', key_file: '{key}'}}\n",
        NodeConfig,
        filename="node.yaml",
    )
    assert config.tls is not None and config.ssl_context() is not None
    assert load_config_text(GOOD, NodeConfig, filename="node.yaml").ssl_context() is None
    assert errors_of(GOOD + f"tls: {{ca_file: '{ca_file}'}}\n") == (
        "node.yaml:8: tls: TLS settings need a wss:// edge_url",
    )
    assert errors_of(wss + f"tls: {{cert_file: '{cert}'}}\n") == (
        "node.yaml:8: tls.key_file: give cert_file and key_file together",
    )
    missing = tmp_path / "nope.pem"
    assert errors_of(wss + f"tls:\n  ca_file: '{missing}'\n") == (
        f"node.yaml:9: tls.ca_file: cannot read '{missing}': No such file or directory",
    )


@pytest.mark.req("warm-standby")
def test_edge_urls_is_the_list_form_of_edge_url() -> None:
    """[warm-standby] edge_urls lists every Edge of an HA group; edge_url is its one-element case."""
    assert load_config_text(GOOD, NodeConfig).urls == ("ws://127.0.0.1:8081",)
    two = GOOD.replace("edge_url: ws://127.0.0.1:8081", "edge_urls: [ws://a:8081, wss://b:8081]")
    assert load_config_text(two, NodeConfig).urls == ("ws://a:8081", "wss://b:8081")
    assert errors_of(GOOD.replace("edge_url: ws://127.0.0.1:8081\n", "")) == (
        "node.yaml:1: edge_url: missing: give edge_url or edge_urls",
    )
    both = GOOD.replace("edge_url: ws://127.0.0.1:8081", "edge_url: ws://a:1\nedge_urls: [ws://b:1]")
    assert errors_of(both) == ("node.yaml:3: edge_urls: give either edge_url or edge_urls, not both",)
    bad = GOOD.replace("edge_url: ws://127.0.0.1:8081", "edge_urls: [ws://a:1, http://b:1, ws://a:1]")
    assert errors_of(bad) == (
        "node.yaml:2: edge_urls[1]: must start with ws:// or wss://, got 'http://b:1'",
        "node.yaml:2: edge_urls[2]: duplicate Edge URL 'ws://a:1'",
    )
