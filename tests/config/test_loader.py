"""iop_config: every problem of a config file is reported with FILE:LINE: path: message."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from typing import Any, ClassVar, Literal

import attrs
import pytest
import trio

from iop_config import (
    ConfigFileError,
    _fast_yaml,
    _loader,
    format_path,
    load_config,
    load_config_text,
    make_converter,
    parse_path,
)
from iop_io import run_in_turns


@attrs.frozen
class Limit:
    id: str
    capacity: int
    weight: float = 1.0
    enabled: bool = True
    mode: Literal["fast", "slow"] = "fast"

    config_key_hints: ClassVar[dict[str, str]] = {"max_queue": "belongs to pool, not to a limit"}

    def __attrs_post_init__(self) -> None:
        if self.capacity == 13:
            raise ValueError("capacity 13 is unlucky")


class ManyProblems(ValueError):
    def __init__(self, problems: list[str]) -> None:
        self.problems = tuple(problems)
        super().__init__("; ".join(problems))


@attrs.frozen
class Pool:
    size: int = 1

    def __attrs_post_init__(self) -> None:
        if self.size < 0:
            raise ManyProblems(["size: must be >= 0", "size: really"])


@attrs.frozen
class Group:
    name: str
    limits: tuple[Limit, ...]


@attrs.frozen
class Doc:
    groups: tuple[Group, ...]
    pool: Pool = attrs.field(factory=Pool)
    tags: list[str] = attrs.field(factory=list)
    labels: dict[str, int] = attrs.field(factory=dict)

    def problems(self) -> Iterator[tuple[str, str]]:
        names = [g.name for g in self.groups]
        for i, name in enumerate(names):
            if name in names[:i]:
                yield f"groups[{i}].name", f"duplicate group name {name!r}"


def load(text: str) -> Doc:
    return load_config_text(textwrap.dedent(text), Doc, filename="doc.yaml")


def errors_of(text: str) -> tuple[str, ...]:
    with pytest.raises(ConfigFileError) as info:
        load(text)
    assert str(info.value) == "\n".join(info.value.errors)
    return info.value.errors


GOOD = """\
groups:
  - name: a
    limits:
      - {id: x, capacity: 2, weight: 3}
      - id: y
        capacity: 1
        enabled: false
        mode: slow
pool: {size: 4}
tags: [one, two]
labels: {k: 1}
"""


def test_valid_document_structures() -> None:
    doc = load(GOOD)
    assert doc == Doc(
        groups=(Group("a", (Limit("x", 2, 3.0), Limit("y", 1, enabled=False, mode="slow"))),),
        pool=Pool(4),
        tags=["one", "two"],
        labels={"k": 1},
    )
    assert type(doc.groups[0].limits[0].weight) is float
    assert type(doc.groups[0].name) is str


@pytest.mark.req("reload-off-loop")
def test_valid_document_never_takes_the_line_numbering_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    """[reload-off-loop] a valid file is read by the fast safe loader only; the round-trip
    parse (for line numbers) runs only when there is a problem to place."""

    real = _loader.parse_round_trip
    calls: list[str] = []

    def counting(text: str, filename: str) -> object:
        calls.append(filename)
        return real(text, filename)

    monkeypatch.setattr(_loader, "parse_round_trip", counting)
    assert load(GOOD).pool == Pool(4)
    assert calls == []
    (error,) = errors_of(GOOD.replace("capacity: 1", "capacity: one"))
    assert error.startswith("doc.yaml:6: groups[0].limits[1].capacity: ")
    assert calls == ["doc.yaml"]


def test_syntax_error_carries_line() -> None:
    errors = errors_of("groups:\n  - name: a\n    limits: [\n  bad: : :\n")
    assert len(errors) == 1
    assert errors[0].startswith("doc.yaml:")
    assert "YAML syntax error" in errors[0]
    line = int(errors[0].split(":")[1])
    assert line in (3, 4)


def test_syntax_error_mapping_value_line() -> None:
    assert errors_of("pool:\n  size: 1\ntags: a: b\n") == (
        "doc.yaml:3: YAML syntax error: mapping values are not allowed here",
    )


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("groups: []\npool:\n  size: !!int abc\n", "doc.yaml:3: YAML error: not a valid !!int value"),
        ("groups: []\ntags: [a, !!bool maybe]\n", "doc.yaml:2: YAML error: not a valid !!bool value"),
        ("groups: []\n\nlabels: {k: !!float s3cret}\n", "doc.yaml:3: YAML error: not a valid !!float value"),
        ("groups: []\n&a {}: *a\n", "doc.yaml:1: YAML error: the document cannot be read (TypeError)"),
    ],
)
def test_value_its_tag_refuses_is_a_yaml_error_with_its_line(text: str, error: str) -> None:
    """ruamel.yaml raises a bare ValueError/KeyError (no position) for these; the loader reports
    them like any YAML error, at the tagged value's line, without echoing the value."""
    assert errors_of(text) == (error,)


def test_list_as_a_key_is_an_unknown_key() -> None:
    assert errors_of("groups: []\n? [a]\n: 1\n") == ("doc.yaml:2: [('a',)]: unknown key ('a',)",)


def test_duplicate_key_is_an_error() -> None:
    (error,) = errors_of("groups: []\npool: {size: 1}\ngroups: []\n")
    assert error.startswith("doc.yaml:3: YAML syntax error:")
    assert "duplicate key" in error


def test_unknown_key_reports_its_own_line() -> None:
    assert errors_of("groups: []\npool:\n  size: 1\n  colour: red\n") == (
        "doc.yaml:4: pool.colour: unknown key 'colour'",
    )


def test_key_hint_replaces_unknown_key_message() -> None:
    text = "groups:\n  - name: a\n    limits:\n      - id: x\n        capacity: 1\n        max_queue: 3\n"
    assert errors_of(text) == ("doc.yaml:6: groups[0].limits[0].max_queue: belongs to pool, not to a limit",)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('"2"', "must be an integer, got a string"),
        ("2.5", "must be an integer, got a float"),
        ("true", "must be an integer, got a boolean"),
        ("null", "must be an integer, got null"),
        ("[1]", "must be an integer, got a list"),
    ],
)
def test_wrong_type_for_integer(value: str, message: str) -> None:
    text = f"groups:\n  - name: a\n    limits:\n      - id: x\n        capacity: {value}\n"
    assert errors_of(text) == (f"doc.yaml:5: groups[0].limits[0].capacity: {message}",)


def test_wrong_types_for_other_scalars_and_containers() -> None:
    text = """\
    groups:
      - name: 12
        limits:
          - {id: x, capacity: 1, weight: fast, enabled: "yes", mode: medium}
    pool: 3
    tags: abc
    labels: [1]
    """
    assert errors_of(text) == (
        "doc.yaml:2: groups[0].name: must be a string, got an integer (quote it)",
        "doc.yaml:4: groups[0].limits[0].weight: must be a number, got a string",
        "doc.yaml:4: groups[0].limits[0].enabled: must be true or false, got a string",
        "doc.yaml:4: groups[0].limits[0].mode: must be one of 'fast', 'slow'",
        "doc.yaml:5: pool: must be a mapping, got an integer",
        "doc.yaml:6: tags: must be a list, got a string",
        "doc.yaml:7: labels: must be a mapping, got a list",
    )


def test_nested_list_index_paths() -> None:
    text = """\
    groups:
      - name: a
        limits:
          - {id: x, capacity: 1}
      - name: b
        limits:
          - {id: y, capacity: 1}
          - id: z
            capacity: nope
    """
    assert errors_of(text) == ("doc.yaml:9: groups[1].limits[1].capacity: must be an integer, got a string",)


def test_missing_key_points_at_nearest_parent() -> None:
    text = "groups:\n  - name: a\n    limits:\n      - id: x\n\n      - capacity: 2\n"
    assert errors_of(text) == (
        "doc.yaml:4: groups[0].limits[0].capacity: required key missing",
        "doc.yaml:6: groups[0].limits[1].id: required key missing",
    )


def test_missing_top_level_key() -> None:
    assert errors_of("# a comment\npool: {size: 1}\n") == ("doc.yaml:2: groups: required key missing",)


def test_document_must_be_a_mapping() -> None:
    assert errors_of("- 1\n") == ("doc.yaml:1: must be a mapping, got a list",)
    assert errors_of("") == ("doc.yaml:1: must be a mapping, got null",)


def test_value_error_from_post_init_is_reported_at_the_object() -> None:
    text = "groups:\n  - name: a\n    limits:\n      - {id: x, capacity: 1}\n      - {id: y, capacity: 13}\n"
    assert errors_of(text) == ("doc.yaml:5: groups[0].limits[1]: capacity 13 is unlucky",)


def test_error_with_problems_reports_each() -> None:
    assert errors_of("groups: []\n\npool:\n  size: -1\n") == (
        "doc.yaml:3: pool: size: must be >= 0",
        "doc.yaml:3: pool: size: really",
    )


def test_problems_hook_reports_cross_field_rules() -> None:
    text = "groups:\n  - name: a\n    limits: []\n  - name: a\n    limits: []\n"
    assert errors_of(text) == ("doc.yaml:4: groups[1].name: duplicate group name 'a'",)


def test_multiple_errors_reported_at_once_sorted_by_line() -> None:
    text = """\
    labels: {k: x}
    groups:
      - name: a
        limits:
          - {id: x, capacity: z}
          - {capacity: 1}
    extra: 1
    """
    assert errors_of(text) == (
        "doc.yaml:1: labels.k: must be an integer, got a string",
        "doc.yaml:5: groups[0].limits[0].capacity: must be an integer, got a string",
        "doc.yaml:6: groups[0].limits[1].id: required key missing",
        "doc.yaml:7: extra: unknown key 'extra'",
    )


def test_error_message_never_echoes_the_value() -> None:
    (error,) = errors_of("groups:\n  - name: a\n    limits:\n      - {id: x, capacity: s3cret-value}\n")
    assert "s3cret" not in error


def test_load_config_reads_a_file(tmp_path) -> None:
    path = tmp_path / "doc.yaml"
    path.write_text(GOOD, encoding="utf-8")
    assert load_config(path, Doc).pool == Pool(4)
    path.write_text("groups: []\nbogus: 1\n", encoding="utf-8")
    with pytest.raises(ConfigFileError) as info:
        load_config(str(path), Doc)
    assert info.value.errors == (f"{path}:2: bogus: unknown key 'bogus'",)


def test_unreadable_file_is_a_config_file_error(tmp_path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigFileError) as info:
        load_config(missing, Doc)
    assert info.value.errors[0].startswith(f"{missing}: cannot read:")


def test_custom_converter_is_used() -> None:
    converter = make_converter()
    converter.register_structure_hook(Pool, lambda value, _: Pool(size=len(value)))
    doc = load_config_text("groups: []\npool: [a, b, c]\n", Doc, converter=converter)
    assert doc.pool == Pool(3)


def test_default_filename() -> None:
    with pytest.raises(ConfigFileError) as info:
        load_config_text("{}", Doc)
    assert info.value.errors == ("<config>:1: groups: required key missing",)


def test_paths_round_trip() -> None:
    path = ("nodes", 0, "providers", 12, "capacity")
    assert format_path(path) == "nodes[0].providers[12].capacity"
    assert parse_path("nodes[0].providers[12].capacity") == path
    assert format_path(("labels", "a b")) == "labels['a b']"
    assert parse_path("labels['a b']") == ("labels", "a b")


SCALARS = """\
groups:
  - name: '7'
    limits:
      - {id: "1", capacity: 1}
      - {id: yes, capacity: 0o17, weight: 1_000}
      - {id: on, capacity: 0x1F, weight: 1, enabled: true}
tags: [no, off, '1', 'x']
labels: {a: 1, '1': 2, n: -3}
"""


@pytest.mark.req("reload-off-loop")
@pytest.mark.parametrize("yields_gil", [False, True])
def test_yaml_1_2_scalars_resolved_once_per_value_and_quoting(yields_gil: bool) -> None:
    """[reload-off-loop] the fast loader keeps YAML 1.2 rules (yes/on/no are strings, 0o and 0x
    ints) and resolves a repeated value by its quoting: quoted '1' is a string where plain 1
    is an integer, in the same document; the reload path (yields_gil) reads the same."""
    doc = load_config_text(SCALARS, Doc, filename="doc.yaml", yields_gil=yields_gil)
    assert [(x.id, x.capacity, x.weight) for x in doc.groups[0].limits] == [
        ("1", 1, 1.0),
        ("yes", 15, 1000.0),
        ("on", 31, 1.0),
    ]
    assert doc.groups[0].name == "7"
    assert doc.tags == ["no", "off", "1", "x"]
    assert doc.labels == {"a": 1, "1": 2, "n": -3}


@pytest.mark.req("reload-off-loop")
def test_reload_path_reports_errors_with_lines_like_the_start_path() -> None:
    """[reload-off-loop] the same problems, at the same lines, whichever path reads the file."""
    text = GOOD.replace("capacity: 1", "capacity: one").replace("{size: 4}", "{size: four}")
    found = []
    for yields_gil in (False, True):
        with pytest.raises(ConfigFileError) as info:
            load_config_text(text, Doc, filename="doc.yaml", yields_gil=yields_gil)
        found.append(info.value.errors)
    assert found[0] == found[1]
    assert [error.split(": ")[0:2] for error in found[0]] == [
        ["doc.yaml:6", "groups[0].limits[1].capacity"],
        ["doc.yaml:9", "pool.size"],
    ]


@pytest.mark.req("reload-off-loop")
@pytest.mark.parametrize("anchors", [False, True])
async def test_a_load_that_yields_gives_the_loop_turns_as_the_document_is_read_and_changes_nothing(
    anchors: bool, loop_turns: Any
) -> None:
    """[reload-off-loop] A load with ``yields_gil`` calls ``iop_io.yield_to_loop`` once per
    PAUSE_EVERY parser events (the fast path) or tree nodes freed (a document with anchors,
    read by the safe loader): run in turns with the loop, the loop gets that many turns, and
    the result is the same as without them."""
    limits = "".join(f"      - {{id: l{i}, capacity: 2}}\n" for i in range(200))
    text = f"groups:\n  - name: g\n    limits:\n{limits}"
    if anchors:
        text = text.replace("{id: l0,", "&first {id: l0,")
    with trio.fail_after(10):
        paused = await run_in_turns(lambda: load_config_text(text, Doc, filename="doc.yaml", yields_gil=True))
    assert paused == load_config_text(text, Doc, filename="doc.yaml")
    items = 200 * 5 + 8  # each limit: a mapping's start, 2 keys, 2 values ... (at least)
    assert loop_turns.count >= items // _fast_yaml.PAUSE_EVERY
