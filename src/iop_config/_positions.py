"""Where a problem is in the file: paths, and their lines from a round-trip parse.

Only when something is wrong -- a YAML error or a config problem -- is the text parsed again with
the round-trip loader, whose mappings and sequences remember where each key and item starts
(``CommentedMap.lc.key(k)``, ``CommentedSeq.lc.item(i)``, 0-based), to find the lines.

Every problem carries a *path* -- a tuple of mapping keys and list indexes such as
``("nodes", 0, "providers", 1, "capacity")`` -- built from cattrs' exception notes or parsed from a
``problems()`` hook's path string. The line of a path is the line of its deepest part that exists
in the file, so a missing key points at its parent.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Generator, Iterable, Iterator, Mapping
from enum import Enum
from typing import Any, Literal, TypeVar, cast, final, get_args, get_origin

from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
)
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.constructor import ConstructorError, RoundTripConstructor
from ruamel.yaml.error import MarkedYAMLError, YAMLError
from ruamel.yaml.events import (
    ScalarEvent,
)
from ruamel.yaml.nodes import MappingNode, ScalarNode, SequenceNode

from iop_config._fast_yaml import Yaml12Resolver

T = TypeVar("T")

Path = tuple[str | int, ...]


@final
class ConfigFileError(Exception):
    """A config file could not be loaded; ``errors`` lists every problem found.

    Each entry reads ``FILE:LINE: FIELD.PATH: message`` (the path is left out
    for problems of the document as a whole). ``str(err)`` joins them with
    newlines.
    """

    def __init__(self, errors: Iterable[str]) -> None:
        self.errors: tuple[str, ...] = tuple(errors)
        super().__init__("\n".join(self.errors))


def format_path(path: Path) -> str:
    """Render a path as ``nodes[0].providers[1].capacity``."""
    out: list[str] = []
    for part in path:
        if isinstance(part, int):
            out.append(f"[{part}]")
        elif isinstance(part, str) and PLAIN_KEY.fullmatch(part):
            out.append(f".{part}" if out else part)
        else:
            out.append(f"[{part!r}]")
    return "".join(out)


def parse_path(text: str) -> Path:
    """Parse a path written by :func:`format_path` (or by a ``problems()`` hook)."""
    parts: list[str | int] = []
    for name, index, quoted in PATH_PART.findall(text):
        if index:
            parts.append(int(index))
        elif quoted:
            parts.append(quoted[1:-1])
        else:
            parts.append(name)
    return tuple(parts)


PLAIN_KEY = re.compile(r"[A-Za-z0-9_\-]+")
PATH_PART = re.compile(r"\.?([^.\[\]]+)|\[(\d+)\]|\[('[^']*'|\"[^\"]*\")\]")


def unreadable(text: str, filename: str, exc: Exception) -> str:
    """``FILE:LINE: YAML error: ...`` for a document ruamel.yaml failed on with a bare exception.

    Its constructors raise ``ValueError`` or ``KeyError`` without a position on
    ``!!int abc`` or ``!!bool maybe`` (the safe and the round-trip loader
    alike), and other bare exceptions on some tagged or anchored mapping keys.
    The line is that of the first explicitly tagged scalar its tag's
    constructor refuses, found from the parser's events; else line 1. The
    value itself is never repeated (it may be a secret).
    """
    yaml = YAML(typ="safe")
    yaml.Resolver = Yaml12Resolver
    constructor = yaml.constructor
    tagged = (event for event in yaml.parse(text) if type(event) is ScalarEvent and event.tag is not None)
    for event in tagged:
        try:
            constructor.construct_non_recursive_object(ScalarNode(event.tag, event.value), event.tag)
        except YAMLError:
            continue  # a tag the safe loader does not know: not this problem
        except Exception:
            short = str(event.tag).replace("tag:yaml.org,2002:", "!!")
            return f"{filename}:{event.start_mark.line + 1}: YAML error: not a valid {short} value"
    return f"{filename}:1: YAML error: the document cannot be read ({type(exc).__name__})"


class RoundTripLineConstructor(RoundTripConstructor):
    """ruamel's round-trip constructor, with no generator of its own left suspended for an unknown tag.

    A node with a tag no constructor knows is built in two steps: the empty,
    tagged value first, its contents once the rest of the document is known.
    ruamel's generator for it turns ``GeneratorExit`` into ``ConstructorError``,
    so when a load fails between the two steps, the garbage collector reports
    an ignored exception at whatever moment it finds the generator. Here
    ruamel's generator gives the tagged value and is closed at once (its second
    step only keeps anchors for dumping, which a config never does), and the
    contents are filled by this plain generator.
    """

    def construct_unknown(self, node: Any) -> Iterator[Any]:
        steps = cast(Generator[Any, None, None], super().construct_unknown(node))  # annotated as an Iterator
        value = next(steps)
        with contextlib.suppress(ConstructorError):
            steps.close()
        yield value
        if isinstance(node, MappingNode):
            self.construct_mapping(node, value)
        elif isinstance(node, SequenceNode):
            value.extend(self.construct_sequence(node))


RoundTripLineConstructor.add_constructor(None, RoundTripLineConstructor.construct_unknown)


def parse_round_trip(text: str, filename: str) -> Any:
    yaml = YAML(typ="rt")
    yaml.Constructor = RoundTripLineConstructor
    try:
        return yaml.load(text)
    except MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        what = exc.problem or exc.context or "invalid YAML"
        raise ConfigFileError([f"{filename}:{line}: YAML syntax error: {what}"]) from None
    except YAMLError as exc:
        raise ConfigFileError([f"{filename}:1: YAML error: {exc}"]) from None
    except Exception as exc:  # as in load_config_text
        raise ConfigFileError([unreadable(text, filename, exc)]) from None


def plain_of(node: Any) -> Any:
    """Copy ruamel's round-trip tree into plain dict/list/str/int/float/bool."""
    if isinstance(node, Mapping):
        return {plain_of(k): plain_of(v) for k, v in node.items()}
    if isinstance(node, list):
        return [plain_of(v) for v in node]
    if isinstance(node, bool) or type(node).__name__ == "ScalarBoolean":
        return bool(node)
    if isinstance(node, int):
        return int(node)
    if isinstance(node, float):
        return float(node)
    if isinstance(node, str):
        return str(node)
    return node


def line_of(tree: Any, path: Path) -> int:
    """1-based line of the deepest part of ``path`` present in the file."""
    line = 1
    if isinstance(tree, CommentedMap | CommentedSeq) and tree.lc.line is not None:
        line = tree.lc.line + 1
    node = tree
    for part in path:
        try:
            if isinstance(node, CommentedMap) and part in node:
                line = node.lc.key(part)[0] + 1
            elif isinstance(node, CommentedSeq) and isinstance(part, int) and 0 <= part < len(node):
                line = node.lc.item(part)[0] + 1
            else:
                break
        except (KeyError, TypeError, IndexError):  # merged (<<) keys have no position
            break
        node = node[part]
    return line


def collect_problems(exc: BaseException, path: Path, type_: Any, found: list[tuple[Path, str]]) -> None:
    """Flatten cattrs' exception tree into ``(path, message)`` problems."""
    if isinstance(exc, ClassValidationError | IterableValidationError):
        # A class note names an attribute; a list or mapping note an index or key.
        with_notes, without = exc.group_exceptions()
        for sub, note in with_notes:
            part = note.name if isinstance(note, AttributeValidationNote) else note.index
            collect_problems(sub, (*path, part), note.type, found)
        for sub in without:
            collect_problems(sub, path, None, found)
    elif isinstance(exc, ForbiddenExtraKeysError):
        hints: Mapping[str, str] = getattr(exc.cl, "config_key_hints", {})
        for key in sorted(exc.extra_fields, key=str):
            found.append(((*path, key), hints.get(key) or f"unknown key {key!r}"))
    elif isinstance(exc, KeyError):
        found.append((path, "required key missing"))
    elif isinstance(exc, ValueError) and isinstance(problems := getattr(exc, "problems", None), tuple):
        found.extend((path, str(problem)) for problem in problems)
    elif get_origin(type_) is Literal:
        choices = ", ".join(repr(choice) for choice in get_args(type_))
        found.append((path, f"must be one of {choices}"))
    elif isinstance(type_, type) and issubclass(type_, Enum):
        choices = ", ".join(repr(member.value) for member in type_)
        found.append((path, f"must be one of {choices}"))
    elif isinstance(exc, ValueError | TypeError):
        found.append((path, str(exc)))
    else:
        found.append((path, f"{type(exc).__name__}: {exc}"))
