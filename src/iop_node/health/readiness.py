"""What a readiness probe asks each kind of backend, how its answer is judged, and the thresholds.

Sans-I/O (h11's shape): :func:`probe_paths` says what to ``GET``, :func:`judge` turns the
answers into a :class:`ProbeResult`, and :class:`Readiness` applies Envoy's unhealthy /
healthy thresholds to a run of results. The I/O is :mod:`iop_node.health.probe`'s.

The backends' own signals (each kind's docs):

- ``llama_cpp``: ``GET /health`` answers 200 when a model is loaded and 503 while it is
  loading; ``GET /slots`` lists the server's slots (its own parallelism), when the
  server exposes it (``--slots``; otherwise 501, which is not a failure). Each slot
  gives its ``n_ctx`` and ``is_processing``; a slot that ran a task also its
  ``n_prompt_tokens`` (recent servers) and ``next_token.n_decoded``: the engine's view
  (:class:`~iop_wire.EngineView`) is the slots' ``n_ctx`` summed, the processing ones'
  prompt and decoded tokens summed, and their ratio. llama-cpp-python's server has no
  ``/slots``: it reports no view.
- ``vllm``: ``GET /health`` answers 200 while the engine is alive (it may still answer
  200 with a hung engine core: the forward-progress watchdog is for that); ``GET
  /metrics`` (Prometheus text) gives the requests running and waiting, the KV-cache use
  and the preemptions since the engine started: the engine's view.
- ``ollama``: ``GET /api/ps`` (the models loaded) answers 200 when the server is up;
  Ollama loads a model on demand, so none loaded is not "not ready".
- ``openai``: ``GET {base_url}/models`` answers 200 on any OpenAI-compatible server.
"""

from __future__ import annotations

import json
from typing import Final, final

import attrs
from prometheus_client.parser import text_string_to_metric_families

from iop_wire import MAX_ENGINE_COUNT, EngineView

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
    "vllm:num_preemptions": "preemptions",  # the counter ``vllm:num_preemptions_total``
    "vllm:num_preemptions_total": "preemptions",  # the same without its ``# TYPE`` line
}
VLLM_NAMES: Final = tuple(_VLLM_GAUGES)
"""The metric names of vLLM's page that the engine's view reads (:func:`vllm_lines` keeps their lines)."""
_KEPT: Final = (*VLLM_NAMES, "#")  # a line kept starts with a name read, or is a comment naming one


@final
@attrs.frozen
class ProbeResult:
    """One probe's verdict.

    Attributes:
        ready: the backend can serve now.
        reason: why not (or what it said), for the report and the logs; "" when ready
            with nothing to tell.
        capacity: the backend's own parallelism, when it says (llama.cpp's slots).
        engine: the engine's own view of its KV cache and queue, when it gives one.
    """

    ready: bool
    reason: str = ""
    capacity: int | None = None
    engine: EngineView | None = None


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
        capacity, engine = _slots(answers[1])
        return ProbeResult(True, capacity=capacity, engine=engine)
    if kind == "vllm" and len(answers) > 1:
        reason, engine = _vllm_load(answers[1])
        return ProbeResult(True, reason, engine=engine)
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


def _slots(answer: tuple[int, bytes]) -> tuple[int | None, EngineView | None]:
    """llama.cpp's parallelism and the engine's view from its ``/slots`` (None, None if unreadable)."""
    status, body = answer
    if status != 200:
        return None, None
    try:
        slots = json.loads(body)
    except ValueError:
        return None, None
    if not isinstance(slots, list) or not slots:
        return None, None
    return len(slots), _slots_view(slots)


def _slots_view(slots: list[object]) -> EngineView | None:
    """The slots' context (``n_ctx`` summed), the tokens the processing ones hold (prompt and
    decoded), their ratio, and the slots processing; a figure the server does not give is None,
    and so is the view when it gives none of them."""
    capacity: int | None = 0
    held: int | None = 0
    running: int | None = 0
    for slot in slots:
        if not isinstance(slot, dict):
            return None
        capacity = _plus(capacity, slot.get("n_ctx"))
        processing = slot.get("is_processing")
        if processing is True:
            running = _plus(running, 1)
            held = _plus(_plus(held, slot.get("n_prompt_tokens")), _decoded(slot.get("next_token")))
        elif processing is not False:
            running = None
    if running is None or not capacity or (held is not None and held > capacity):
        held = None  # which slots run, or their context, not said; or more held than they hold
    view = EngineView(
        held / capacity if held is not None and capacity else None, held, capacity or None, running=running
    )
    return None if view == _NO_VIEW else view


def _decoded(next_token: object) -> object:
    """``next_token.n_decoded``: an object on older servers, an array of one on newer ones."""
    if isinstance(next_token, list) and len(next_token) == 1:
        next_token = next_token[0]
    return next_token.get("n_decoded") if isinstance(next_token, dict) else None


def _plus(total: int | None, value: object) -> int | None:
    """``total + value`` while both are counts (None from the first that is not, or past the bound)."""
    if total is None or type(value) is not int or value < 0:
        return None
    total += value
    return total if total <= MAX_ENGINE_COUNT else None


def _count(value: float | None) -> int | None:
    """A Prometheus sample as a count (None if it is not a whole number in bounds)."""
    if value is None or not 0 <= value <= MAX_ENGINE_COUNT or value != int(value):
        return None
    return int(value)


def _vllm_load(answer: tuple[int, bytes]) -> tuple[str, EngineView | None]:
    """``running 3, waiting 0, kv_cache 0.41`` from vLLM's Prometheus text, and the engine's
    view of it (``"", None`` if unreadable)."""
    status, body = answer
    if status != 200:
        return "", None
    seen: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(vllm_lines(body.decode("utf-8", "replace"))):
            name = _VLLM_GAUGES.get(family.name)
            if name is not None:
                samples = (s.value for s in family.samples if not s.name.endswith("_created"))
                seen[name] = seen.get(name, 0.0) + sum(samples)
    except ValueError:
        return "", None
    reason = ", ".join(f"{name} {value:g}" for name, value in seen.items() if name != "preemptions")
    kv_use = seen.get("kv_cache")
    if kv_use is not None and not 0.0 <= kv_use <= 1.0:
        kv_use = None  # NaN, or beyond the cache: not a figure
    view = EngineView(
        kv_use,
        preemptions=_count(seen.get("preemptions")),
        running=_count(seen.get("running")),
        waiting=_count(seen.get("waiting")),
    )
    return reason, (None if view == _NO_VIEW else view)


def vllm_lines(text: str) -> str:
    """The lines of ``text`` the view reads, for the library to parse: the samples of
    :data:`_VLLM_GAUGES`' families (a line that starts with one of their names) and the comments
    that name one, whole and in order.

    The rest of a vLLM page -- dozens of histograms of latencies and sizes, most of its lines --
    is never parsed: the parser's cost is per line, and a probe comes every second. The lines are
    found where the names occur (``str.find``), not by reading every line. The families read are
    the ones a parse of the whole page gives (``tests/node/test_vllm_view.py`` compares the two).
    """
    spans: set[tuple[int, int]] = set()
    for name in VLLM_NAMES:
        at = text.find(name)
        while at != -1:
            end = text.find("\n", at)
            end = len(text) if end == -1 else end
            spans.add((text.rfind("\n", 0, at) + 1, end))
            at = text.find(name, end)
    keep = []
    for start, end in sorted(spans):
        line = text[start:end].lstrip()
        if line.startswith(_KEPT):
            keep.append(line)
    return "\n".join(keep)


_NO_VIEW: Final = EngineView()


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
        engine: the engine's own view, from the last pass (None when it gave none, or not ready).
    """

    unhealthy_threshold: int
    healthy_threshold: int
    ready: bool = True
    reason: str = ""
    capacity: int | None = None
    engine: EngineView | None = None
    _streak: int = 0

    def observe(self, result: ProbeResult) -> bool:
        """Count one probe result; return whether :attr:`ready`, :attr:`reason`, :attr:`capacity`
        or :attr:`engine` changed.

        While ready, a pass's reason is what the backend tells about its load (vLLM's
        running and waiting requests): kept, but not a change worth a report; its engine
        view is (the Edge reads its KV use and preemptions), once per probe at most.
        """
        if result.ready and self.ready and not self._streak:  # the usual probe: ready, and it was
            self.reason = result.reason
            changed = result.capacity != self.capacity or result.engine != self.engine
            self.capacity, self.engine = result.capacity, result.engine
            return changed
        before = (self.ready, self.capacity, self.reason if not self.ready else "", self.engine)
        if result.ready != self.ready:
            self._streak += 1
            if self._streak < (self.healthy_threshold if result.ready else self.unhealthy_threshold):
                return False
            self.ready = result.ready
        self._streak = 0
        self.reason = result.reason
        if result.ready:
            self.capacity = result.capacity
        self.engine = result.engine if self.ready else None
        return before != (self.ready, self.capacity, self.reason if not self.ready else "", self.engine)
