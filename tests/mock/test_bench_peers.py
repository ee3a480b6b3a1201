"""The LiteLLM configs of the peer comparisons (``benchmarks.peers``), read back as LiteLLM reads them (YAML).

No LiteLLM runs here: these check that what the benchmarks hand it says what docs/benchmarks.md says
it was configured with.
"""

from __future__ import annotations

from typing import Any

import yaml
from benchmarks import peers


def _read(text: str) -> dict[str, Any]:
    config = yaml.safe_load(text)
    assert isinstance(config, dict)
    return config


def test_ejection_config_has_two_deployments_of_one_model_with_health_check_routing() -> None:
    config = _read(peers.ejection_config(4001, 4002))
    deployments = config["model_list"]
    assert [d["model_name"] for d in deployments] == ["m", "m"]
    assert [d["model_info"]["id"] for d in deployments] == ["gpu0", "gpu1"]
    assert [d["litellm_params"]["api_base"] for d in deployments] == [
        "http://127.0.0.1:4001/v1",
        "http://127.0.0.1:4002/v1",
    ]
    for deployment in deployments:
        params = deployment["litellm_params"]
        assert (params["timeout"], params["stream_timeout"]) == (6.0, 6.0)
        assert deployment["model_info"]["health_check_timeout"] == 2.0
    assert (
        config["general_settings"]
        | {
            "background_health_checks": True,
            "health_check_interval": 1,
            "enable_health_check_routing": True,
        }
        == config["general_settings"]
    )
    router = config["router_settings"]
    assert (router["num_retries"], router["allowed_fails"], router["cooldown_time"], router["timeout"]) == (
        2,
        3,
        5.0,
        6.0,
    )
    assert "fallbacks" not in router


def test_deadline_config_falls_back_in_our_order_with_the_deadline_as_every_timeout() -> None:
    config = _read(peers.deadline_config(5000, 5001, 5002, 0.5))
    assert [(d["model_name"], d["model_info"]["id"]) for d in config["model_list"]] == [
        ("d0", "gpu0"),
        ("d1", "gpu1"),
        ("d2", "gpu2"),
    ]
    assert {d["litellm_params"]["stream_timeout"] for d in config["model_list"]} == {0.5}
    assert "health_check_timeout" not in config["model_list"][0]["model_info"]
    router = config["router_settings"]
    assert router["fallbacks"] == [{"d0": ["d1", "d2"]}]
    assert (router["num_retries"], router["timeout"], router["cooldown_time"]) == (0, 0.5, 0.0)
    assert config["general_settings"]["background_health_checks"] is False
    assert "enable_health_check_routing" not in config["general_settings"]
    assert config["litellm_settings"]["request_timeout"] == 0.5


def test_health_verdict_reads_the_background_checks_by_deployment_id() -> None:
    answer = {
        "healthy_endpoints": [{"model": "openai/mock", "model_id": "gpu1"}],
        "unhealthy_endpoints": [{"model": "openai/mock", "model_id": "gpu0", "error": "timeout"}],
    }
    assert peers.health_verdict(answer, "gpu0") == "ejected"
    assert peers.health_verdict(answer, "gpu1") == "online"
    assert peers.health_verdict({"healthy_endpoints": [], "unhealthy_endpoints": None}, "gpu0") == "unknown"
