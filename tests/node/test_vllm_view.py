"""The engine's view from vLLM's ``/metrics`` ([token-ledger]): the probe parses only the lines of
the families it reads (:func:`~iop_node.health.readiness.vllm_lines`), and reads from them what a
parse of the whole page gives -- on pages of any shape: the families it reads among histograms and
decoys whose names start like theirs, comments that name them, label values that hold their names,
indented lines, CRLF line ends, families without ``# HELP`` or ``# TYPE``."""

from __future__ import annotations

import pytest
from benchmarks import engine_view
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from iop_node.health import readiness
from iop_node.health.readiness import VLLM_NAMES, judge, vllm_lines
from iop_wire import EngineView

pytestmark = pytest.mark.req("token-ledger")

DECOYS = (
    "vllm:num_requests_running_max",
    "vllm:kv_cache_usage_perc_peak",
    "vllm:e2e_request_latency_seconds",
    "process_cpu_seconds",
)
WORDS = st.sampled_from(("the", "engine", "cache", "requests", *VLLM_NAMES))
LABEL_VALUES = st.sampled_from(("Qwen/Qwen3-32B", "0", "a b", *VLLM_NAMES))


@st.composite
def families(draw: st.DrawFn) -> tuple[str, list[str]]:
    """One family's name and lines: maybe ``# HELP`` and ``# TYPE``, then its samples."""
    name = draw(st.sampled_from(VLLM_NAMES + DECOYS))
    kind = draw(st.sampled_from(("gauge", "counter", "untyped", "histogram")))
    lines = []
    if draw(st.booleans()):
        lines.append(f"# HELP {name} {' '.join(draw(st.lists(WORDS, max_size=4)))}")
    if draw(st.booleans()):
        lines.append(f"# TYPE {name} {kind}")
    for _ in range(draw(st.integers(1, 3))):
        labels = f'{{model_name="{draw(LABEL_VALUES)}",engine="{draw(st.integers(0, 2))}"}}'
        value = draw(st.sampled_from(("0", "1", "2.5", "0.25", "7", "NaN", "1e3")))
        if kind == "histogram":
            lines += [f'{name}_bucket{{le="0.5"}} {value}', f"{name}_sum {value}", f"{name}_count {value}"]
        elif kind == "counter":
            lines.append(f"{name}_total{labels} {value}")
            if draw(st.booleans()):
                lines.append(f"{name}_created{labels} 1.7e9")
        else:
            lines.append(f"{name}{labels} {value}")
    return name, lines


@st.composite
def pages(draw: st.DrawFn, valid: bool = True) -> str:
    """A page of families; ``valid``: each declared once, no two exposing the same samples (a
    counter ``x`` exposes ``x_total``), as Prometheus' text format requires; else a name may come
    back, even with another type."""
    blocks = draw(
        st.lists(families(), max_size=8, unique_by=(lambda block: block[0].removesuffix("_total")) if valid else None)
    )
    lines = [line for _, block in blocks for line in block]
    indent = draw(st.sampled_from(("", " ", "\t")))
    end = draw(st.sampled_from(("\n", "\r\n")))
    return "".join(f"{indent if draw(st.booleans()) else ''}{line}{end}" for line in lines)


def _read(text: str) -> list[tuple[str, str, list[tuple[str, dict[str, str], str]]]]:
    """The families the view reads, each sample's value as text (NaN equals itself there)."""
    return [
        (f.name, f.type, [(s.name, s.labels, repr(s.value)) for s in f.samples])
        for f in text_string_to_metric_families(text)
        if f.name in VLLM_NAMES
    ]


@settings(max_examples=300, deadline=None)
@given(pages())
def test_the_lines_kept_read_as_the_whole_page(page: str) -> None:
    assert _read(vllm_lines(page)) == _read(page)


@settings(max_examples=300, deadline=None)
@given(pages(valid=False))
def test_the_view_is_the_whole_pages_even_on_a_page_that_declares_a_family_twice(page: str) -> None:
    """Where a name comes back, the whole page has two families of it and the lines kept may have
    one: the view sums a name's samples, so it is the same."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(readiness, "vllm_lines", lambda text: text)  # the whole page parsed
        whole = judge("vllm", ((200, b""), (200, page.encode())))
    assert judge("vllm", ((200, b""), (200, page.encode()))) == whole


def test_only_the_families_read_are_kept() -> None:
    page = (
        "# HELP vllm:e2e_request_latency_seconds latency\n"
        "# TYPE vllm:e2e_request_latency_seconds histogram\n"
        'vllm:e2e_request_latency_seconds_bucket{le="0.5"} 3\n'
        "vllm:e2e_request_latency_seconds_count 3\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        '  vllm:kv_cache_usage_perc{model_name="m"} 0.25\r\n'
        "process_cpu_seconds_total 12\n"
        "vllm:num_requests_running 2"
    )
    assert vllm_lines(page).split("\n") == [
        "# TYPE vllm:kv_cache_usage_perc gauge",
        'vllm:kv_cache_usage_perc{model_name="m"} 0.25\r',
        "vllm:num_requests_running 2",
    ]


def test_a_page_shaped_like_vllms_gives_its_view() -> None:
    """The page ``benchmarks.engine_view`` measures on (vLLM's families, histograms and process
    figures): the view it holds, and the same families as the whole page."""
    page = engine_view.vllm_page()
    result = judge("vllm", ((200, b""), (200, page)))
    assert result.engine == EngineView(0.41, preemptions=1234, running=12, waiting=3)
    assert _read(vllm_lines(page.decode())) == _read(page.decode())
    assert len(vllm_lines(page.decode()).split("\n")) < page.count(b"\n") / 20
