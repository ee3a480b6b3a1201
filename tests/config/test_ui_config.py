"""The ``ui`` section of edge.yaml: the live queue page's switch, tokens and limits.

[queue-page]
"""

from __future__ import annotations

import pathlib
import textwrap

import pytest

from iop_config import ConfigFileError
from iop_edge.config import EdgeConfig, UiConfig, load_edge_config

BASE = """\
listen: 127.0.0.1:8080
node_listen: 127.0.0.1:8081
nodes:
  - id: node-a
    token: dev-token
    providers: [{id: gpu0, capacity: 1}]
models:
  - id: m
    candidates: [{node: node-a, provider: gpu0}]
"""


@pytest.fixture(autouse=True)
def in_tmp(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("IOP_TEST_VIEWER", raising=False)


def load(extra: str) -> EdgeConfig:
    pathlib.Path("edge.yaml").write_text(BASE + textwrap.dedent(extra), encoding="utf-8")
    return load_edge_config("edge.yaml")


def errors_of(extra: str) -> tuple[str, ...]:
    with pytest.raises(ConfigFileError) as info:
        load(extra)
    return info.value.errors


@pytest.mark.req("queue-page")
def test_off_by_default() -> None:
    """[queue-page] no ``ui`` section: the page is off, with the documented defaults."""
    ui = load("").ui
    assert ui == UiConfig()
    assert (ui.enabled, ui.max_viewers, ui.update_interval_ms) == (False, 20, 1000)
    assert (ui.max_provider_rows, ui.max_waiter_rows) == (200, 100)


@pytest.mark.req("queue-page")
def test_enabled_needs_a_token() -> None:
    """[queue-page] ``ui.enabled`` without an admin or viewer token is refused; either one will do."""
    (error,) = errors_of("ui: {enabled: true}\n")
    assert "ui.enabled" in error and "needs a token" in error
    assert load("ui: {enabled: true, viewer_token: v}\n").ui.accepts("v", None)
    config = load("admin_token: a\nui: {enabled: true}\n")
    assert config.ui.accepts("a", config.admin_token)
    assert not config.ui.accepts("", config.admin_token)
    assert not config.ui.accepts("v", config.admin_token)


@pytest.mark.req("queue-page")
def test_viewer_token_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """[queue-page] ``viewer_token_env`` names the variable; the token is never in the repr."""
    monkeypatch.setenv("IOP_TEST_VIEWER", "from-env-sentinel")
    config = load("ui: {enabled: true, viewer_token_env: IOP_TEST_VIEWER}\n")
    assert config.ui.viewer_token == "from-env-sentinel"
    assert config.ui.accepts("from-env-sentinel", None)
    assert "from-env-sentinel" not in repr(config)


@pytest.mark.req("queue-page")
def test_limits_are_checked() -> None:
    """[queue-page] every limit has its floor, and both token forms at once are refused."""
    errors = errors_of(
        "ui: {viewer_token: v, viewer_token_env: X, max_viewers: 0, update_interval_ms: 10,"
        " max_provider_rows: 0, max_waiter_rows: 0}\n"
    )
    text = "\n".join(errors)
    for key in ("viewer_token_env", "max_viewers", "update_interval_ms", "max_provider_rows", "max_waiter_rows"):
        assert f"ui.{key}" in text
