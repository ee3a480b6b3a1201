"""What a readiness probe asks each kind of backend, how its answer is judged, and the thresholds.

Sans-I/O (h11's shape): :func:`probe_paths` says what to ``GET``, :func:`judge` turns the
answers into a :class:`ProbeResult`, and :class:`Readiness` applies Envoy's unhealthy /
healthy thresholds to a run of results. The I/O is :mod:`iop_node.health.probe`'s.

The backends' own signals (each kind's docs):

- ``llama_cpp``: ``GET /health`` answers 200 when a model is loaded and 503 while it is
  loading; ``GET /slots`` lists the server's slots (its own parallelism), when the
  server exposes it (``--slots``; otherwise 501, which is not a failure).
- ``vllm``: ``GET /health`` answers 200 while the engine is alive (it may still answer
  200 with a hung engine core: the forward-progress watchdog is for that); ``GET
  /metrics`` (Prometheus text) gives the requests running and waiting and the KV-cache use.
- ``ollama``: ``GET /api/ps`` (the models loaded) answers 200 when the server is up;
  Ollama loads a model on demand, so none loaded is not "not ready".
- ``openai``: ``GET {base_url}/models`` answers 200 on any OpenAI-compatible server.
"""

from __future__ import annotations

import json
from typing import Final, final

import attrs
from prometheus_client.parser import text_string_to_metric_families

READY: Final = "ready"
NOT_READY: Final = "not_ready"
STALLED: Final = "stalled"
STATES: Final = (READY, NOT_READY, STALLED)
"""The states a node reports for a provider (``provider_health.state``, docs/wire.md)."""

_VLLM_GAUGES: Final = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:gpu_cache_usage_perc": "kv_cache",
    "vllm:kv_cache_usage_perc": "kv_cache",
}


@final
@attrs.frozen
class ProbeResult:
    """One probe's verdict.

    Attributes:
        ready: the backend can serve now.
        reason: why not (or what it said), for the report and the logs; "" when ready
            with nothing to tell.
        capacity: the backend's own parallelism, when it says (llama.cpp's slots).
    """

    ready: bool
    reason: str = ""
    capacity: int | None = None


PASSED: Final = ProbeResult(True)
"""A pass with nothing to tell (one result for every such probe: it is immutable)."""


def probe_paths(kind: str) -> tuple[str, ...]:
    """The paths a probe of ``kind`` asks, first the one that decides readiness.

    Paths are on the server root, except ``openai``'s (``models``), which is on the
    provider's ``base_url``. ``none``: nothing.
    """
    return {
        "openai": ("/models",),
        "llama_cpp": ("/health", "/slots"),
        "vllm": ("/health", "/metrics"),
        "ollama": ("/api/ps",),
    }.get(kind, ())


def judge(kind: str, answers: tuple[tuple[int, bytes], ...]) -> ProbeResult:
    """The verdict on a probe's answers (``(status, body)`` per path of :func:`probe_paths`, in order).

    Only the first answer decides readiness; the others add what the backend tells
    about its capacity and load (an answer that cannot be read adds nothing).
    """
    status, body = answers[0]
    if not 200 <= status < 300:
        return ProbeResult(False, _refusal(kind, status, body))
    if kind == "llama_cpp" and len(answers) > 1:
        return ProbeResult(True, capacity=_slots(answers[1]))
    if kind == "vllm" and len(answers) > 1:
        return ProbeResult(True, _vllm_load(answers[1]))
    return PASSED


def _refusal(kind: str, status: int, body: bytes) -> str:
    if kind == "llama_cpp" and status == 503:
        return f"loading ({_message(body) or 'HTTP 503'})"
    message = _message(body)
    return f"HTTP {status}" + (f": {message}" if message else "")


def _message(body: bytes) -> str:
    """The backend's own error message (OpenAI's and llama.cpp's ``{"error": {"message"}}``), cut short."""
    try:
        data = json.loads(body)
    except ValueError:
        return ""
    error = data.get("error") if isinstance(data, dict) else None
    message = error.get("message") if isinstance(error, dict) else error
    return message[:200] if isinstance(message, str) else ""


def _slots(answer: tuple[int, bytes]) -> int | None:
    status, body = answer
    if status != 200:
        return None
    try:
        slots = json.loads(body)
    except ValueError:
        return None
    return len(slots) if isinstance(slots, list) and slots else None


def _vllm_load(answer: tuple[int, bytes]) -> str:
    """``running 3, waiting 0, kv_cache 0.41`` from vLLM's Prometheus text ("" if unreadable)."""
    status, body = answer
    if status != 200:
        return ""
    seen: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(body.decode("utf-8", "replace")):
            name = _VLLM_GAUGES.get(family.name)
            if name is not None:
                seen[name] = seen.get(name, 0.0) + sum(sample.value for sample in family.samples)
    except ValueError:
        return ""
    return ", ".join(f"{name} {value:g}" for name, value in seen.items())


@final
@attrs.define
class Readiness:
    """Envoy's thresholds over a run of probe results (sans-I/O; one per provider).

    A provider starts ready (nothing known against it: the Edge's passive health
    covers the time before the first probe); ``unhealthy_threshold`` failures in a row
    make it not ready, ``healthy_threshold`` passes in a row ready again.

    Attributes:
        unhealthy_threshold: failures in a row that make a ready provider not ready.
        healthy_threshold: passes in a row that make a not-ready provider ready.
        ready: the current verdict.
        reason: the last failure's reason while not ready, or what the backend tells.
        capacity: the backend's own parallelism, from the last pass that told it.
    """

    unhealthy_threshold: int
    healthy_threshold: int
    ready: bool = True
    reason: str = ""
    capacity: int | None = None
    _streak: int = 0

    def observe(self, result: ProbeResult) -> bool:
        """Count one probe result; return whether :attr:`ready`, :attr:`reason` or :attr:`capacity` changed.

        While ready, a pass's reason is what the backend tells about its load (vLLM's
        running and waiting requests): kept, but not a change worth a report.
        """
        if result.ready and self.ready and not self._streak:  # the usual probe: ready, and it was
            self.reason = result.reason
            changed = result.capacity != self.capacity
            self.capacity = result.capacity
            return changed
        before = (self.ready, self.capacity, self.reason if not self.ready else "")
        if result.ready != self.ready:
            self._streak += 1
            if self._streak < (self.healthy_threshold if result.ready else self.unhealthy_threshold):
                return False
            self.ready = result.ready
        self._streak = 0
        self.reason = result.reason
        if result.ready:
            self.capacity = result.capacity
        return before != (self.ready, self.capacity, self.reason if not self.ready else "")
