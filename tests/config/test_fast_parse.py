"""[reload-off-loop] the fast path (data built from the C parser's events) reads what the safe
loader and the line-keeping loader read, and a problem is reported at the same line whichever
loader supplied the data.

Documents are generated as YAML events and written by ruamel.yaml's emitter, so every scalar
style, flow and block collections, anchors, aliases, tags, merge keys and duplicate keys occur.
"""

from __future__ import annotations

import gc
import io
import math
import pathlib
import sys
from collections.abc import Callable
from typing import Any
from unittest import mock

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError
from ruamel.yaml.events import (
    AliasEvent,
    DocumentEndEvent,
    DocumentStartEvent,
    MappingEndEvent,
    MappingStartEvent,
    ScalarEvent,
    SequenceEndEvent,
    SequenceStartEvent,
    StreamEndEvent,
    StreamStartEvent,
)

from iop_config import ConfigFileError, _fast_yaml, _loader, _positions, load_config_text
from iop_edge.config import load_edge_config

# Scalars the YAML 1.2 rules read as every kind: ints in all bases, floats, special floats,
# booleans, nulls, YAML 1.1 spellings that stay strings, timestamps, merge and value keys.
TEXTS = (
    *("a", "node-1", "a b", "é", "127.0.0.1:80", "1:20", "=", "<<", ""),
    *("0", "-0", "1", "-3", "+5", "0o17", "0x1F", "0b101", "0777", "1_000", "12345678901234567890"),
    *("1.5", "3.0", "1e3", "-.inf", ".Inf", ".nan", ".NaN", "1.", ".5"),
    *("true", "False", "TRUE", "yes", "no", "on", "off", "~", "null", "Null", "NULL"),
    *("2001-12-14", "2001-12-14T21:59:43.10-05:00"),
)
KEYS = ("a", "b", "id", "1", "1.0", "true", "~", "<<", "=", "yes")
SPECIAL = ("<<", "=")  # merge and value keys: the safe loader's business
STYLES = (None, None, None, "'", '"', "|", ">")
TAGS = (
    "tag:yaml.org,2002:str",
    "tag:yaml.org,2002:int",
    "tag:yaml.org,2002:float",
    "tag:yaml.org,2002:bool",
    "tag:yaml.org,2002:null",
    "tag:yaml.org,2002:binary",
    "!custom",
    "!",
)
COLLECTION_TAGS = ("tag:yaml.org,2002:map", "tag:yaml.org,2002:seq", "tag:yaml.org,2002:set", "!custom")


@attrs.define
class Writer:
    """Draws one document's events; ``features``: anchors, aliases, tags, complex keys."""

    draw: Callable[[st.SearchStrategy[Any]], Any]
    features: bool
    events: list[Any] = attrs.Factory(list)
    anchors: list[str] = attrs.Factory(list)  # of finished nodes only: no recursive aliases
    named: int = 0

    def anchor(self) -> str | None:
        if not self.features or self.draw(st.integers(0, 4)) > 0:
            return None
        self.named += 1
        return f"a{self.named}"

    def tag(self, choices: tuple[str, ...]) -> str | None:
        return self.draw(st.sampled_from(choices)) if self.features and self.draw(st.integers(0, 6)) == 0 else None

    def scalar(self, texts: tuple[str, ...]) -> None:
        texts = texts if self.features else tuple(text for text in texts if text not in SPECIAL)
        anchor, tag, text = self.anchor(), self.tag(TAGS), self.draw(st.sampled_from(texts))
        style = self.draw(st.sampled_from(STYLES))
        implicit = (tag is None and style is None, tag is None)
        self.events.append(ScalarEvent(anchor, tag, implicit, text, style=style))
        self._finished(anchor)

    def node(self, depth: int) -> None:
        kind = self.draw(st.sampled_from(("scalar", "scalar", "map", "seq", "alias") if depth < 3 else ("scalar",)))
        if kind == "alias" and self.features and self.anchors:
            self.events.append(AliasEvent(self.draw(st.sampled_from(self.anchors))))
        elif kind in ("map", "seq"):
            self.collection(kind, depth)
        else:
            self.scalar(TEXTS)

    def collection(self, kind: str, depth: int) -> None:
        anchor, tag, flow = self.anchor(), self.tag(COLLECTION_TAGS), self.draw(st.booleans())
        start, end = (MappingStartEvent, MappingEndEvent) if kind == "map" else (SequenceStartEvent, SequenceEndEvent)
        self.events.append(start(anchor, tag, tag is None, flow_style=flow))
        keys = list(KEYS)
        for _ in range(self.draw(st.integers(0, 4))):
            if kind == "map":
                self.key(depth, keys)
            self.node(depth + 1)
        self.events.append(end())
        self._finished(anchor)

    def key(self, depth: int, unused: list[str]) -> None:
        """A key; without features each text once per mapping (1, 1.0 and true may still collide)."""
        if self.features and self.draw(st.integers(0, 9)) == 0:
            self.node(depth + 1)  # a complex key: a mapping or list as a key
        elif self.features:
            self.scalar(KEYS)
        else:
            text = self.draw(st.sampled_from([text for text in unused if text not in SPECIAL]))
            unused.remove(text)
            self.scalar((text,))

    def _finished(self, anchor: str | None) -> None:
        if anchor is not None:
            self.anchors.append(anchor)


def emit(events: list[Any]) -> str:
    out = io.StringIO()
    YAML(typ="safe").emit(
        [StreamStartEvent(), DocumentStartEvent(), *events, DocumentEndEvent(), StreamEndEvent()], out
    )
    return out.getvalue()


@st.composite
def documents(draw: Any, *, features: bool) -> str:
    writer = Writer(draw, features)
    writer.collection("map", 0)
    return emit(writer.events)


def typed(value: Any) -> Any:
    """``value`` with every type spelled out (``1 == 1.0 == True`` in Python, not in YAML)."""
    if isinstance(value, dict):
        return ("map", [(typed(k), typed(v)) for k, v in value.items()])
    if isinstance(value, list | tuple | set):
        return (type(value).__name__, [typed(v) for v in value])
    if isinstance(value, float) and math.isnan(value):
        return ("float", "nan")
    return (type(value).__name__, value)


def outcome(load: Callable[[], Any]) -> Any:
    try:
        return typed(load())
    except Exception as exc:  # a bad !!int or !!float raises ValueError, not a YAMLError
        return ("error", type(exc).__name__)


@pytest.mark.req("reload-off-loop")
@given(documents(features=True))
def test_fast_path_reads_every_document_as_the_safe_loader_does(text: str) -> None:
    """Anchors, aliases, tags, merge keys, duplicate and complex keys: the same data or the same error."""
    fast = outcome(lambda: _fast_yaml.fast_load(text, release=False))
    assert fast == outcome(lambda: _fast_yaml.safe_load(text, release=True)), text


@pytest.mark.req("reload-off-loop")
@given(documents(features=False))
def test_plain_document_is_built_from_events_alone(text: str) -> None:
    """A document of plain mappings, lists and untagged scalars needs no node tree, and reads as
    the safe loader and the line-keeping loader read it. Only a duplicate key (``1`` and ``1.0``
    are one key) or a timestamp (a type a config never uses) is left to the safe loader."""
    yaml = YAML(typ="safe")
    yaml.Resolver = _fast_yaml.Yaml12Resolver
    safe = outcome(lambda: _fast_yaml.safe_load(text, release=False))
    try:
        fast = typed(_fast_yaml.plain_document(yaml.parse(text), _fast_yaml.Scalars(yaml)))
    except _fast_yaml.NotPlain:
        assert safe == ("error", "DuplicateKeyError") or "2001-12-14" in text, text
        return
    assert fast == safe, text
    assert fast == typed(_positions.plain_of(_positions.parse_round_trip(text, "doc.yaml"))), text


@pytest.mark.req("reload-off-loop")
@given(documents(features=True))
def test_any_document_loads_or_is_a_config_file_error(text: str) -> None:
    """Whatever the YAML holds (bad tagged values such as ``!!int abc`` included), loading gives
    the object or a ``ConfigFileError`` whose every line reads ``FILE:LINE: ...``, never another
    exception."""
    result = loaded(text, "any.yaml")
    if isinstance(result, tuple):
        assert result
        assert all(error.startswith("any.yaml:") and error.split(":")[1].isdigit() for error in result)
    else:
        assert isinstance(result, Service)


@attrs.frozen
class Endpoint:
    name: str
    port: int
    weight: float = 1.0
    tls: bool = False


@attrs.frozen
class Service:
    endpoints: tuple[Endpoint, ...]
    retries: int = 1
    labels: dict[str, str] = attrs.field(factory=dict)


VALUES = {
    "name": ("web", "'8080'", "8080", "~", "[x]"),
    "port": ("8080", "'8080'", "0x50", "8080.0", "true", "{}", "~"),
    "weight": ("2", "2.5", ".inf", "heavy", "[]"),
    "tls": ("true", "false", "yes", "'true'", "1"),
    "retries": ("3", "three", "-1", "null"),
}


@st.composite
def services(draw: Any) -> str:
    """A ``Service`` file, every field spelled right or wrong, present or missing or unknown."""

    def fields(names: tuple[str, ...]) -> list[str]:
        found = [f"{name}: {draw(st.sampled_from(VALUES[name]))}" for name in draw(st.permutations(names))]
        kept = [field for field in found if draw(st.integers(0, 4)) > 0]
        return [*kept, "colour: red"] if draw(st.integers(0, 5)) == 0 else kept

    lines = ["endpoints:"]
    for _ in range(draw(st.integers(0, 3))):
        item = fields(("name", "port", "weight", "tls")) or ["{}"]
        lines.extend([f"  - {item[0]}", *(f"    {field}" for field in item[1:])])
    if len(lines) == 1:
        lines[0] = "endpoints: []"
    lines.extend(fields(("retries",)))
    lines.append(draw(st.sampled_from(("", "labels: {a: b}", "labels: {a: 1}", "labels: [a]"))))
    return "\n".join(lines) + "\n"


def loaded(text: str, filename: str = "svc.yaml") -> Any:
    """The ``Service`` of ``text``, or its errors."""
    try:
        return load_config_text(text, Service, filename=filename)
    except ConfigFileError as exc:
        return exc.errors


@pytest.mark.req("reload-off-loop")
@given(services())
def test_same_object_and_same_file_line_errors_whichever_loader_reads_the_data(text: str) -> None:
    """The fast path, the safe loader (node tree) and the line-keeping loader's data give the
    same object or the same ``FILE:LINE: path: message`` errors."""
    fast = loaded(text)
    with mock.patch.object(_fast_yaml, "plain_document", side_effect=_fast_yaml.NotPlain):
        assert loaded(text) == fast, text
    with mock.patch.object(_loader, "fast_load", side_effect=YAMLError("forced")):
        assert loaded(text) == fast, text


def test_service_generator_writes_both_good_and_bad_files() -> None:
    """The generator above reaches both outcomes (so the property compares objects and errors)."""
    good = "endpoints:\n  - name: web\n    port: 8080\nretries: 2\n"
    assert loaded(good) == Service(endpoints=(Endpoint("web", 8080),), retries=2)
    assert loaded(good.replace("8080", "'8080'")) == (
        "svc.yaml:3: endpoints[0].port: must be an integer, got a string",
    )


EDGE = """\
nodes:
  - id: node-a
    token: t
    providers:
      - &gpu {id: p0, capacity: 4, long_context_capacity: 1, context_window_tokens: 8192}
      - {<<: *gpu, id: p1}
  - id: &b node-b
    token: !!str 1234
    providers: [{id: p0, capacity: 1}]
models:
  - id: m
    candidates: [{node: node-a, provider: p1}, {node: *b, provider: p0}]
"""
PLAIN_EDGE = """\
nodes:
  - id: node-a
    token: t
    providers:
      - {id: p0, capacity: 4, long_context_capacity: 1, context_window_tokens: 8192}
      - {id: p1, capacity: 4, long_context_capacity: 1, context_window_tokens: 8192}
  - id: node-b
    token: '1234'
    providers: [{id: p0, capacity: 1}]
models:
  - id: m
    candidates: [{node: node-a, provider: p1}, {node: node-b, provider: p0}]
"""


@pytest.mark.req("reload-off-loop")
def test_edge_file_with_anchors_merge_keys_and_tags_reads_as_before(tmp_path: pathlib.Path) -> None:
    """Anchors, merge keys and tags in ``edge.yaml`` still work: the safe loader reads such a
    file, the fast path its plain twin, to the same config; errors keep their lines either way."""
    fancy, plain = tmp_path / "fancy.yaml", tmp_path / "plain.yaml"
    fancy.write_text(EDGE)
    plain.write_text(PLAIN_EDGE)
    with mock.patch.object(_fast_yaml, "safe_load", wraps=_fast_yaml.safe_load) as safe:
        assert load_edge_config(plain) == load_edge_config(fancy)
        assert safe.call_count == 1
    assert load_edge_config(fancy).nodes[1].token == "1234"
    for path in (fancy, plain):
        path.write_text(path.read_text().replace("id: p1", "id: p1, priority: x"))
        with pytest.raises(ConfigFileError) as info:
            load_edge_config(path)
        assert [error.removeprefix(str(path)) for error in info.value.errors] == [
            ":6: nodes[0].providers[1].priority: must be an integer, got a string"
        ]


@pytest.mark.req("reload-off-loop")
def test_a_failed_load_leaves_nothing_to_fail_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """A document that fails inside a value with an unknown tag is reported at the failing line,
    and leaves no half-built value whose clean-up raises when the garbage collector finds it
    (ruamel's generator for unknown tags did: an "exception ignored" in some later test)."""
    ignored: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: ignored.append(f"{u.exc_type.__name__}: {u.object!r}"))
    text = '!custom\ntrue: off\n&a1 "true": !custom {}\n"<<": !!int NULL\na: *a1\n'
    assert loaded(text, "tagged.yaml") == ("tagged.yaml:4: YAML error: not a valid !!int value",)
    assert loaded("a: !custom {x: [1, !!int abc]}\n", "tagged.yaml") == (
        "tagged.yaml:1: YAML error: not a valid !!int value",
    )
    gc.collect()
    assert ignored == []
