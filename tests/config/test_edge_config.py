"""The Edge config file: contract keys, defaults, every validation rule, errors with file:line."""

from __future__ import annotations

import hashlib
import importlib.resources
import pathlib
import textwrap

import attrs
import pytest
import trustme

from iop_admission import (
    Admission,
    ModelGroup,
    OutlierPolicy,
    ProviderKey,
    ProviderSpec,
    QueuePolicy,
    RetryPolicy,
    validate_pool,
)
from iop_config import ConfigFileError
from iop_edge.config import EdgeConfig, EdgeProvider, HostPort, load_edge_config, parse_host_port

EXAMPLE = importlib.resources.files("iop_stack") / "examples" / "edge.yaml"
GPU0 = ProviderKey("node-a", "gpu0")
GPU1 = ProviderKey("node-a", "gpu1")

# Line numbers matter: tests below name them.
BASE = """\
listen: 127.0.0.1:8080
node_listen: 127.0.0.1:8081
heartbeat_timeout_ms: 15000
provider_pool: {max_queue: 64, queue_timeout_ms: 30000}
nodes:
  - id: node-a
    token: dev-token
    providers:
      - id: gpu0
        capacity: 1
        long_context_capacity: 1
        context_window_tokens: 32768
        total_context_tokens: 32768
      - {id: gpu1, capacity: 2}
models:
  - id: "ornith:35b"
    long_context_threshold_tokens: 8192
    candidates: [{node: node-a, provider: gpu0, upstream_model: "qwen3:35b"}]
  - id: ornith-fast
    candidates:
      - {node: node-a, provider: gpu0}
"""


@pytest.fixture(autouse=True)
def in_tmp(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for name in ("IOP_TEST_TOKEN", "IOP_TEST_ADMIN", "IOP_TEST_KEYS"):
        monkeypatch.delenv(name, raising=False)


def load(text: str) -> EdgeConfig:
    pathlib.Path("edge.yaml").write_text(textwrap.dedent(text), encoding="utf-8")
    return load_edge_config("edge.yaml")


def errors_of(text: str) -> tuple[str, ...]:
    with pytest.raises(ConfigFileError) as info:
        load(text)
    return info.value.errors


def edit(old: str, new: str, text: str = BASE) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


@pytest.mark.req("cross-model-tests")
def test_example_edge_yaml_maps_to_a_valid_pool_config() -> None:
    """iop-stack's packaged edge.yaml: the local stack's pool, [cross-model-tests] models."""
    with importlib.resources.as_file(EXAMPLE) as path:
        config = load_edge_config(path)
    pool = config.pool_config()
    validate_pool(pool)
    assert pool.policy == QueuePolicy(max_queue=64, queue_timeout=30.0)
    assert dict(pool.providers) == {
        GPU0: ProviderSpec(
            capacity=1, long_context_capacity=1, context_window_tokens=32768, total_context_tokens=32768, priority=0
        ),
        GPU1: ProviderSpec(
            capacity=2, long_context_capacity=1, context_window_tokens=32768, total_context_tokens=32768, priority=-1
        ),
    }
    assert dict(pool.models) == {
        "ornith:35b": ModelGroup(candidates=(GPU0, GPU1)),
        "ornith-fast": ModelGroup(candidates=(GPU0,)),
    }
    assert config.listen == HostPort("127.0.0.1", 8080)
    assert config.node_listen == ("127.0.0.1", 8081)
    assert config.node_token("node-a") == "dev-token"
    assert config.long_threshold("ornith:35b") == 8192
    assert config.long_threshold("ornith-fast") is None
    assert config.upstream_model("ornith:35b", GPU1) == "qwen3:35b"
    assert len(Admission(pool).snapshot().providers) == 2


def test_defaults() -> None:
    config = load("""\
        nodes: [{id: n, token: t, providers: [{id: p, capacity: 3}]}]
        models: [{id: m, candidates: [{node: n, provider: p}]}]
        """)
    assert config.listen == HostPort("127.0.0.1", 8080)
    assert config.node_listen == HostPort("127.0.0.1", 8081)
    assert config.heartbeat_timeout_ms == 15000
    assert config.provider_pool.policy() == QueuePolicy(max_queue=64, queue_timeout=30.0)
    assert config.max_body_bytes == 4194304
    assert config.max_ws_message_bytes == 8388608
    assert (config.max_answer_bytes, config.answer_budget_bytes) == (16 * 1024 * 1024, 256 * 1024 * 1024)
    assert config.admin_token is None and not config.accepts_admin_token("")
    assert config.api_keys is None and not config.api_keys_required
    spec = config.pool_config().providers[ProviderKey("n", "p")]
    assert spec == ProviderSpec(
        capacity=3,
        long_context_capacity=0,
        context_window_tokens=0,
        total_context_tokens=None,
        priority=0,
        enabled=True,
    )
    assert config.upstream_model("m", ProviderKey("n", "p")) == "m"  # default: the model id
    assert config.long_threshold("m") is None
    assert config.node_token("nobody") is None


@pytest.mark.req("reload-off-loop")
def test_the_pool_is_built_and_validated_once_per_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """[reload-off-loop] Loading builds each provider's spec once and validates the pool once: the
    loaded config keeps the pool its check validated (secrets resolved from the environment or
    not), so a reload's ``prepare_refresh`` of it checks no spec again. A config made otherwise
    builds its own pool on first use."""
    built: list[str] = []
    checked: list[str] = []
    spec, problems = EdgeProvider.spec, ProviderSpec.problems
    monkeypatch.setattr(EdgeProvider, "spec", lambda self: built.append(self.id) or spec(self))
    monkeypatch.setattr(ProviderSpec, "problems", lambda self, *a: checked.append("") or problems(self, *a))
    monkeypatch.setenv("IOP_TEST_TOKEN", "from-env")
    admission = Admission(load(BASE).pool_config())
    for text in (BASE, edit("token: dev-token", "token_env: IOP_TEST_TOKEN")):
        built.clear()
        config = load(text)
        assert built == ["gpu0", "gpu1"]
        pool = config.pool_config()
        assert config.pool_config() is pool and built == ["gpu0", "gpu1"]
        checked.clear()
        admission.prepare_refresh(pool)
        assert checked == []
    made = attrs.evolve(config)
    built.clear()
    assert made.pool_config() == pool and made.pool_config() is not pool
    assert built == ["gpu0", "gpu1"]
    assert made.pool_config() is made.pool_config() and built == ["gpu0", "gpu1"]


def test_queue_timeout_ms_becomes_seconds() -> None:
    config = load(edit("{max_queue: 64, queue_timeout_ms: 30000}", "{max_queue: 0, queue_timeout_ms: 1500}"))
    assert config.pool_config().policy == QueuePolicy(max_queue=0, queue_timeout=1.5)


def test_upstream_model_of_a_non_candidate_is_a_key_error() -> None:
    config = load(BASE)
    assert config.upstream_model("ornith-fast", GPU0) == "ornith-fast"
    with pytest.raises(KeyError):
        config.upstream_model("ornith-fast", GPU1)
    with pytest.raises(KeyError):
        config.upstream_model("nope", GPU0)


@pytest.mark.req("queue-ownership")
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            edit("        capacity: 1\n", "        capacity: 1\n        max_queue: 8\n"),
            "edge.yaml:11: nodes[0].providers[0].max_queue: queue settings belong to "
            "provider_pool (Edge-wide), not to a provider",
        ),
        (
            edit("{id: gpu1, capacity: 2}", "{id: gpu1, capacity: 2, queue_timeout_ms: 5}"),
            "edge.yaml:14: nodes[0].providers[1].queue_timeout_ms: queue settings belong to "
            "provider_pool (Edge-wide), not to a provider",
        ),
        (
            edit("  - id: ornith-fast\n", "  - id: ornith-fast\n    max_queue: 3\n"),
            "edge.yaml:20: models[1].max_queue: queue settings belong to provider_pool (Edge-wide), not to a model",
        ),
        (
            edit("{node: node-a, provider: gpu0}", "{node: node-a, provider: gpu0, max_queue: 1}"),
            "edge.yaml:21: models[1].candidates[0].max_queue: queue settings belong to "
            "provider_pool (Edge-wide), not to a candidate",
        ),
        (
            edit("    token: dev-token\n", "    token: dev-token\n    queue_timeout_ms: 10\n"),
            "edge.yaml:8: nodes[0].queue_timeout_ms: queue settings belong to provider_pool (Edge-wide), not to a node",
        ),
        (
            "max_queue: 10\n" + BASE,
            "edge.yaml:1: max_queue: belongs under provider_pool (provider_pool: {max_queue: ...})",
        ),
    ],
)
def test_queue_settings_outside_provider_pool_point_to_provider_pool(text: str, expected: str) -> None:
    """[queue-ownership] the message names provider_pool, not a generic unknown key."""
    assert errors_of(text) == (expected,)


def test_unknown_key_is_an_error_with_its_line() -> None:
    assert errors_of(edit("        capacity: 1\n", "        capacity: 1\n        gpus: 2\n")) == (
        "edge.yaml:11: nodes[0].providers[0].gpus: unknown key 'gpus'",
    )


def test_capacity_must_be_at_least_one() -> None:
    assert errors_of(edit("{id: gpu1, capacity: 2}", "{id: gpu1, capacity: 0}")) == (
        "edge.yaml:14: nodes[0].providers[1].capacity: must be >= 1, got 0",
    )


@pytest.mark.req("long-state")
def test_long_context_capacity_at_most_capacity() -> None:
    """[long-state] long_context_capacity <= capacity."""
    text = edit("        long_context_capacity: 1\n", "        long_context_capacity: 2\n")
    text = edit("        total_context_tokens: 32768\n", "", text)
    assert errors_of(text) == (
        "edge.yaml:11: nodes[0].providers[0].long_context_capacity: must be <= capacity (2 > 1)",
    )


@pytest.mark.req("long-state")
def test_total_context_tokens_must_equal_window_times_long_capacity() -> None:
    """[long-state] total_context_tokens == context_window_tokens * long_context_capacity."""
    (error,) = errors_of(edit("total_context_tokens: 32768", "total_context_tokens: 65536"))
    assert error.startswith("edge.yaml:13: nodes[0].providers[0].total_context_tokens: must equal")
    assert "32768 * 1 = 32768, got 65536" in error


def test_wrong_type_is_reported() -> None:
    assert errors_of(edit("{id: gpu1, capacity: 2}", "{id: gpu1, capacity: two}")) == (
        "edge.yaml:14: nodes[0].providers[1].capacity: must be an integer, got a string",
    )


def test_duplicate_ids() -> None:
    text = BASE + "  - id: ornith-fast\n    candidates: [{node: node-a, provider: gpu1}]\n"
    text = edit(
        "      - {id: gpu1, capacity: 2}\n", "      - {id: gpu1, capacity: 2}\n      - {id: gpu0, capacity: 1}\n", text
    )
    text = text.replace("models:\n", "  - id: node-a\n    token: x\n    providers: []\nmodels:\n")
    assert errors_of(text) == (
        "edge.yaml:15: nodes[0].providers[2].id: duplicate provider id 'gpu0' (first at nodes[0].providers[0])",
        "edge.yaml:16: nodes[1].id: duplicate node id 'node-a' (first at nodes[0])",
        "edge.yaml:26: models[2].id: duplicate model id 'ornith-fast' (first at models[1])",
    )


def test_empty_ids_are_rejected() -> None:
    assert errors_of(edit("  - id: ornith-fast\n", '  - id: ""\n')) == (
        "edge.yaml:19: models[1].id: must not be empty",
    )


def test_candidates_must_name_configured_node_and_provider() -> None:
    text = edit(
        "      - {node: node-a, provider: gpu0}\n",
        "      - {node: node-b, provider: gpu0}\n      - {node: node-a, provider: gpu7}\n",
    )
    assert errors_of(text) == (
        "edge.yaml:21: models[1].candidates[0].node: node 'node-b' is not configured under nodes",
        "edge.yaml:22: models[1].candidates[1].provider: node 'node-a' has no provider 'gpu7'",
    )


def test_duplicate_candidate_in_a_model() -> None:
    text = edit(
        "      - {node: node-a, provider: gpu0}\n",
        "      - {node: node-a, provider: gpu0}\n      - {node: node-a, provider: gpu0}\n",
    )
    assert errors_of(text) == (
        "edge.yaml:22: models[1].candidates[1]: node-a/gpu0 is listed twice (first at candidates[0])",
    )


def test_model_needs_a_candidate_and_a_positive_threshold() -> None:
    text = edit("    candidates:\n      - {node: node-a, provider: gpu0}\n", "    candidates: []\n")
    text = edit("long_context_threshold_tokens: 8192", "long_context_threshold_tokens: 0", text)
    assert errors_of(text) == (
        "edge.yaml:17: models[0].long_context_threshold_tokens: must be >= 1, got 0",
        "edge.yaml:20: models[1].candidates: must list at least one provider",
    )


def test_global_bounds() -> None:
    text = edit("heartbeat_timeout_ms: 15000", "heartbeat_timeout_ms: 99")
    text = edit("{max_queue: 64, queue_timeout_ms: 30000}", "{max_queue: -1, queue_timeout_ms: 0}", text)
    text = "max_body_bytes: 0\nmax_ws_message_bytes: 0\n" + text
    assert errors_of(text) == (
        "edge.yaml:1: max_body_bytes: must be >= 1, got 0",
        "edge.yaml:2: max_ws_message_bytes: must be >= 1, got 0",
        "edge.yaml:5: heartbeat_timeout_ms: must be >= 100, got 99",
        "edge.yaml:6: provider_pool.max_queue: must be >= 0, got -1",
        "edge.yaml:6: provider_pool.queue_timeout_ms: must be >= 1, got 0",
    )


def test_the_answer_budget_takes_at_least_one_answer() -> None:
    text = "max_answer_bytes: 0\nanswer_budget_bytes: 0\n" + edit(
        "heartbeat_timeout_ms: 15000", "heartbeat_timeout_ms: 100"
    )
    assert errors_of(text) == ("edge.yaml:1: max_answer_bytes: must be >= 1, got 0",)
    text = "max_answer_bytes: 2048\nanswer_budget_bytes: 2047\n" + edit(
        "heartbeat_timeout_ms: 15000", "heartbeat_timeout_ms: 100"
    )
    assert errors_of(text) == (
        "edge.yaml:2: answer_budget_bytes: must be >= max_answer_bytes (2048: one answer must fit), got 2047",
    )
    config = load(
        "max_answer_bytes: 2048\nanswer_budget_bytes: 2048\n"
        + edit("heartbeat_timeout_ms: 15000", "heartbeat_timeout_ms: 100")
    )
    assert (config.max_answer_bytes, config.answer_budget_bytes) == (2048, 2048)


def test_heartbeat_and_limits_accept_their_minimum() -> None:
    text = edit("heartbeat_timeout_ms: 15000", "heartbeat_timeout_ms: 100")
    text = "max_body_bytes: 1\nmax_ws_message_bytes: 1\n" + text
    config = load(edit("{max_queue: 64, queue_timeout_ms: 30000}", "{max_queue: 0, queue_timeout_ms: 1}", text))
    assert (config.heartbeat_timeout_ms, config.max_body_bytes, config.max_ws_message_bytes) == (100, 1, 1)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("8080", "must be a 'host:port' string, e.g. '127.0.0.1:8080'"),
        ("'localhost'", "must be 'host:port', e.g. '127.0.0.1:8080'"),
        ("':8080'", "must be 'host:port', e.g. '127.0.0.1:8080'"),
        ("'localhost:http'", "port must be an integer from 0 to 65535"),
        ("'localhost:65536'", "port must be an integer from 0 to 65535"),
        ("'::1:8080'", "an IPv6 host goes in brackets, e.g. '[::1]:8080'"),
    ],
)
def test_listen_must_be_host_port(value: str, message: str) -> None:
    assert errors_of(edit("listen: 127.0.0.1:8080", f"listen: {value}")) == (f"edge.yaml:1: listen: {message}",)


def test_listen_parsing() -> None:
    assert parse_host_port("[::1]:0") == HostPort("::1", 0)
    assert str(HostPort("::1", 0)) == "[::1]:0"
    assert parse_host_port("0.0.0.0:65535") == ("0.0.0.0", 65535)
    assert errors_of(edit("127.0.0.1:8081", "127.0.0.1:8080")) == (
        "edge.yaml:2: node_listen: must differ from listen (127.0.0.1:8080)",
    )


def test_token_exactly_one_of_token_or_token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IOP_TEST_TOKEN", "from-env")
    both = edit("    token: dev-token\n", "    token: dev-token\n    token_env: IOP_TEST_TOKEN\n")
    assert errors_of(both) == ("edge.yaml:8: nodes[0].token_env: give exactly one of token or token_env, not both",)
    assert errors_of(edit("    token: dev-token\n", "")) == (
        "edge.yaml:6: nodes[0]: required: one of token or token_env",
    )
    assert errors_of(edit("token: dev-token", 'token: ""')) == ("edge.yaml:7: nodes[0].token: must not be empty",)


def test_token_env_is_resolved_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    text = edit("token: dev-token", "token_env: IOP_TEST_TOKEN")
    assert errors_of(text) == (
        "edge.yaml:7: nodes[0].token_env: environment variable 'IOP_TEST_TOKEN' is not set or empty",
    )
    monkeypatch.setenv("IOP_TEST_TOKEN", "")
    assert len(errors_of(text)) == 1
    monkeypatch.setenv("IOP_TEST_TOKEN", "s3cret-node")
    config = load(text)
    assert config.node_token("node-a") == "s3cret-node"
    assert "s3cret-node" not in repr(config)
    assert "s3cret-node" not in repr(config.nodes[0])


def test_tokens_never_appear_in_repr(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IOP_TEST_ADMIN", "admin-s3cret")
    config = load("admin_token_env: IOP_TEST_ADMIN\napi_keys: [key-s3cret]\n" + BASE)
    assert config.node_token("node-a") == "dev-token"
    for obj in (config, *config.nodes):
        assert "dev-token" not in repr(obj)
        assert "admin-s3cret" not in repr(obj)
        assert "key-s3cret" not in repr(obj)


def test_admin_token(monkeypatch: pytest.MonkeyPatch) -> None:
    config = load("admin_token: adm\n" + BASE)
    assert config.accepts_admin_token("adm")
    assert not config.accepts_admin_token("adm2")
    assert errors_of("admin_token: adm\nadmin_token_env: IOP_TEST_ADMIN\n" + BASE) == (
        "edge.yaml:2: admin_token_env: give exactly one of admin_token or admin_token_env, not both",
    )
    assert errors_of("admin_token_env: IOP_TEST_ADMIN\n" + BASE) == (
        "edge.yaml:1: admin_token_env: environment variable 'IOP_TEST_ADMIN' is not set or empty",
    )
    monkeypatch.setenv("IOP_TEST_ADMIN", "from-env")
    assert load("admin_token_env: IOP_TEST_ADMIN\n" + BASE).accepts_admin_token("from-env")


def test_api_keys_are_stored_as_sha256_digests() -> None:
    config = load("api_keys: [alpha, beta]\n" + BASE)
    assert config.api_keys_required
    assert [d.hexdigest for d in config.api_keys or ()] == [
        hashlib.sha256(b"alpha").hexdigest(),
        hashlib.sha256(b"beta").hexdigest(),
    ]
    assert config.accepts_api_key("beta")
    assert not config.accepts_api_key("gamma")
    assert "alpha" not in repr(config.api_keys)


def test_api_keys_env_is_a_comma_separated_list(monkeypatch: pytest.MonkeyPatch) -> None:
    text = "api_keys_env: IOP_TEST_KEYS\n" + BASE
    assert errors_of(text) == (
        "edge.yaml:1: api_keys_env: environment variable 'IOP_TEST_KEYS' is not set or holds no "
        "keys (expected a comma-separated list)",
    )
    monkeypatch.setenv("IOP_TEST_KEYS", " one, two ,,")
    config = load(text)
    assert [d.hexdigest for d in config.api_keys or ()] == [
        hashlib.sha256(b"one").hexdigest(),
        hashlib.sha256(b"two").hexdigest(),
    ]
    assert config.accepts_api_key("two")


def test_api_keys_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IOP_TEST_KEYS", "one")
    assert errors_of("api_keys: [a]\napi_keys_env: IOP_TEST_KEYS\n" + BASE) == (
        "edge.yaml:2: api_keys_env: give at most one of api_keys or api_keys_env",
    )
    assert errors_of("api_keys: []\n" + BASE) == (
        "edge.yaml:1: api_keys: must list at least one key (leave the key out to disable API keys)",
    )
    assert errors_of("api_keys: [a, '']\n" + BASE) == ("edge.yaml:1: api_keys[1]: must be a non-empty string",)


def test_every_problem_is_reported_at_once_with_its_line() -> None:
    text = edit("heartbeat_timeout_ms: 15000", "heartbeat_timeout_ms: 10")
    text = edit("{id: gpu1, capacity: 2}", "{id: gpu1, capacity: 0}", text)
    text = edit("provider: gpu0}\n", "provider: gpu9}\n", text)
    text = edit("    token: dev-token\n", "    token: dev-token\n    colour: red\n", text)
    # The structural error (unknown key) stops before cross-field rules run: no partial object.
    assert errors_of(text) == ("edge.yaml:8: nodes[0].colour: unknown key 'colour'",)
    text = edit("    colour: red\n", "", text)
    assert errors_of(text) == (
        "edge.yaml:3: heartbeat_timeout_ms: must be >= 100, got 10",
        "edge.yaml:14: nodes[0].providers[1].capacity: must be >= 1, got 0",
        "edge.yaml:21: models[1].candidates[0].provider: node 'node-a' has no provider 'gpu9'",
    )


@pytest.mark.req("node-socket-limits")
def test_node_socket_limit_keys_defaults_and_bounds() -> None:
    """[node-socket-limits] the node socket's deadline, caps and reject backoff: defaults, bounds, mapping."""
    config = load(BASE)
    assert (
        config.node_handshake_timeout_ms,
        config.node_max_pending,
        config.node_max_pending_per_address,
        config.node_reject_backoff_base_ms,
        config.node_reject_backoff_max_ms,
    ) == (5000, 256, 8, 100, 5000)
    limits = config.node_socket_limits()
    assert (limits.max_pending, limits.max_pending_per_source, limits.backoff_base, limits.backoff_max) == (
        256,
        8,
        0.1,
        5.0,
    )
    text = (
        "node_handshake_timeout_ms: 0\nnode_max_pending: 0\nnode_max_pending_per_address: 0\n"
        "node_reject_backoff_base_ms: 300\nnode_reject_backoff_max_ms: 200\n" + BASE
    )
    assert errors_of(text) == (
        "edge.yaml:1: node_handshake_timeout_ms: must be >= 1, got 0",
        "edge.yaml:2: node_max_pending: must be >= 1, got 0",
        "edge.yaml:3: node_max_pending_per_address: must be >= 1, got 0",
        "edge.yaml:5: node_reject_backoff_max_ms: must be >= 300, got 200",
    )


@pytest.mark.req("reconnect-storm")
def test_node_listen_backlog_default_bound_and_lookups_by_id() -> None:
    """[reconnect-storm] node_listen_backlog: default 4096, >= 1; the per-registration and
    per-request lookups (token, threshold, upstream model) answer as a scan would."""
    config = load(BASE)
    assert config.node_listen_backlog == 4096
    assert load("node_listen_backlog: 20000\n" + BASE).node_listen_backlog == 20000
    assert errors_of("node_listen_backlog: 0\n" + BASE) == ("edge.yaml:1: node_listen_backlog: must be >= 1, got 0",)
    for node in config.nodes:
        assert config.node_token(node.id) == node.token
    assert config.node_token("nobody") is None
    for model in config.models:
        assert config.long_threshold(model.id) == model.long_context_threshold_tokens
        for c in model.candidates:
            assert config.upstream_model(model.id, c.key) == (c.upstream_model or model.id)
    assert config.long_threshold("nobody") is None


@pytest.mark.req("failover-before-first-byte", "outlier-ejection", "first-token-timeout")
def test_retry_and_outlier_defaults_and_mapping() -> None:
    """[failover-before-first-byte] [outlier-ejection] [first-token-timeout] defaults: 2 attempts,
    3 failures, 5 s doubling up to 300 s; first-token timeout off."""
    config = load(BASE)
    pool = config.pool_config()
    assert pool.retry == RetryPolicy(max_attempts=2)
    assert pool.outlier == OutlierPolicy(consecutive_failures=3, base_ejection=5.0, max_ejection=300.0)
    assert config.first_token_timeout("ornith:35b") is None
    text = edit(
        "{max_queue: 64, queue_timeout_ms: 30000}",
        "{max_queue: 64, queue_timeout_ms: 30000, retry: {max_attempts: 3},"
        " outlier: {consecutive_failures: 0, base_ejection_ms: 250, max_ejection_ms: 1000}}",
    )
    text = edit("    long_context_threshold_tokens: 8192\n", "    first_token_timeout_ms: 1500\n", text)
    config = load(text)
    pool = config.pool_config()
    assert pool.retry == RetryPolicy(max_attempts=3)
    assert pool.outlier == OutlierPolicy(consecutive_failures=0, base_ejection=0.25, max_ejection=1.0)
    assert config.first_token_timeout("ornith:35b") == 1.5
    assert config.first_token_timeout("ornith-fast") is None


@pytest.mark.req("outlier-ejection")
def test_retry_and_outlier_bounds_all_reported() -> None:
    """[outlier-ejection] every bad retry/outlier/first-token value is reported at once, file and line."""
    text = edit(
        "{max_queue: 64, queue_timeout_ms: 30000}",
        "{max_queue: 64, queue_timeout_ms: 30000, retry: {max_attempts: 0},"
        " outlier: {consecutive_failures: -1, base_ejection_ms: 0, max_ejection_ms: -5}}",
    )
    text = edit("    long_context_threshold_tokens: 8192\n", "    first_token_timeout_ms: 0\n", text)
    assert errors_of(text) == (
        "edge.yaml:4: provider_pool.retry.max_attempts: must be >= 1, got 0",
        "edge.yaml:4: provider_pool.outlier.consecutive_failures: must be >= 0, got -1",
        "edge.yaml:4: provider_pool.outlier.base_ejection_ms: must be >= 1, got 0",
        "edge.yaml:4: provider_pool.outlier.max_ejection_ms: must be >= base_ejection_ms (0)",
        "edge.yaml:17: models[0].first_token_timeout_ms: must be >= 1, got 0",
    )
    assert errors_of(edit("{max_queue: 64, queue_timeout_ms: 30000}", "{retry: {attempts: 2}}")) == (
        "edge.yaml:4: provider_pool.retry.attempts: unknown key 'attempts'",
    )


@pytest.mark.req("tls")
def test_node_tls_file_errors_name_the_file_and_the_field(tmp_path: pathlib.Path) -> None:
    """[tls] a missing file and a key that does not match its certificate are config errors at their
    field's line, naming the file; good files load."""
    ca = trustme.CA()
    leaf, other = ca.issue_cert("127.0.0.1"), ca.issue_cert("127.0.0.1")
    cert, key, other_key = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "other-key.pem"
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    other.private_key_pem.write_to_path(str(other_key))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))

    def node_tls(cert_file: pathlib.Path, key_file: pathlib.Path, ca_file: str = "") -> str:
        lines = f"node_tls:\n  cert_file: {cert_file}\n  key_file: {key_file}\n"
        return lines + (f"  client_ca_file: {ca_file}\n" if ca_file else "")

    config = load(node_tls(cert, key, str(tmp_path / "ca.pem")) + BASE)
    assert config.node_tls is not None and config.node_tls.client_ca_file == str(tmp_path / "ca.pem")
    missing = tmp_path / "missing.pem"
    assert errors_of(node_tls(missing, key) + BASE) == (
        f"edge.yaml:2: node_tls.cert_file: cannot read '{missing}': No such file or directory",
    )
    assert errors_of(node_tls(cert, other_key) + BASE) == (
        f"edge.yaml:3: node_tls.key_file: '{other_key}' does not match the certificate in cert_file",
    )
    assert errors_of(node_tls(cert, key, str(key)) + BASE) == (
        f"edge.yaml:4: node_tls.client_ca_file: '{key}' holds no PEM certificate",
    )
    assert errors_of(node_tls(key, key) + BASE) == (
        f"edge.yaml:2: node_tls.cert_file: '{key}' holds no PEM certificate",
    )


# [reload-off-loop] Providers written alike are structured once (the memo), their spec built once.

TWO_NODES = edit(
    "models:",
    """\
  - id: node-b
    token: dev-token
    providers:
      - {id: gpu1, capacity: 2}
models:""",
)


def _providers(config: EdgeConfig) -> dict[ProviderKey, EdgeProvider]:
    return {ProviderKey(node.id, p.id): p for node in config.nodes for p in node.providers}


@pytest.mark.req("reload-off-loop")
def test_providers_written_alike_share_one_object_and_one_spec_across_loads() -> None:
    """[reload-off-loop] A provider mapping written alike on two nodes, or in the next load of the
    file, gives the same (frozen) provider object, whose spec is built once; the pool holds it."""
    first = load(TWO_NODES)
    a, b = _providers(first)[GPU1], _providers(first)[ProviderKey("node-b", "gpu1")]
    assert a is b and a == EdgeProvider(id="gpu1", capacity=2)
    pool = first.pool_config()
    assert pool.providers[GPU1] is pool.providers[ProviderKey("node-b", "gpu1")] is a.spec()
    again = load(TWO_NODES)
    assert _providers(again)[GPU1] is a and again.pool_config().providers[GPU1] is a.spec()


@pytest.mark.req("reload-off-loop")
def test_a_changed_provider_is_structured_anew() -> None:
    """[reload-off-loop] A provider whose mapping changed (a value, its type, a key) is structured
    anew; the memo never stands in for a different mapping."""
    before = _providers(load(TWO_NODES))[ProviderKey("node-b", "gpu1")]
    changed = _providers(load(edit("{id: gpu1, capacity: 2}\nmodels:", "{id: gpu1, capacity: 3}\nmodels:", TWO_NODES)))
    assert changed[ProviderKey("node-b", "gpu1")].capacity == 3
    assert changed[GPU1] is before  # node-a's, unchanged
    enabled = _providers(
        load(edit("{id: gpu1, capacity: 2}\nmodels:", "{id: gpu1, capacity: 2, enabled: true}\nmodels:", TWO_NODES))
    )
    assert enabled[ProviderKey("node-b", "gpu1")] == before and enabled[ProviderKey("node-b", "gpu1")] is not before


@pytest.mark.req("reload-off-loop")
@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("true", "must be an integer, got a boolean"),
        ("1.0", "must be an integer, got a float"),
        ("'1'", "must be an integer, got a string"),
        ("[1]", "must be an integer, got a list"),
    ],
)
def test_a_value_equal_in_python_is_not_the_remembered_one(value: str, message: str) -> None:
    """[reload-off-loop] ``capacity: 1`` is remembered; ``true`` and ``1.0`` equal ``1`` in Python but
    are still refused with their line, in the same file and in the next load (a failed load
    remembers nothing), and the file with ``1`` loads as before afterwards."""
    one = edit(
        "{id: gpu1, capacity: 2}",
        "{id: gpu1, capacity: 1}",
        TWO_NODES.replace("capacity: 2}\nmodels:", "capacity: 1}\nmodels:"),
    )
    good = load(one)
    bad = edit("{id: gpu1, capacity: 1}\nmodels:", f"{{id: gpu1, capacity: {value}}}\nmodels:", one)
    line = bad.splitlines().index(f"      - {{id: gpu1, capacity: {value}}}") + 1
    assert errors_of(bad) == (f"edge.yaml:{line}: nodes[1].providers[0].capacity: {message}",)
    assert load(one) == good


def test_a_node_id_no_node_could_register_with_is_refused() -> None:
    """The config refuses what ``register`` refuses (docs/wire.md): a node id
    over 128 characters or with a character that is not printable."""
    long_id = "n" * 129
    text = edit("- id: node-a\n", f"- id: {long_id}\n").replace("node: node-a", f"node: {long_id}")
    (error,) = errors_of(text)
    assert error.endswith("nodes[0].id: must be at most 128 printable characters (a node could not register)")
    assert (
        "nodes[0].id"
        in errors_of(edit("- id: node-a\n", '- id: "node\\u0085a"\n').replace("node: node-a", 'node: "node\\u0085a"'))[
            0
        ]
    )
