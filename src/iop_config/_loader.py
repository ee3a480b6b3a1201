"""Load a YAML config file into frozen attrs classes, with file:line errors.

Fast first, lines only on error [reload-off-loop]: the file is read by
ruamel.yaml's C parser (``ruamel.yaml.clib``) under YAML 1.2 rules -- the same
rules as the round-trip loader -- and the plain ``dict``/``list``/scalars for
cattrs are built straight from the parser's events, each distinct scalar
resolved and constructed once per file by the safe loader's own resolver
(:class:`_Yaml12Resolver`) and constructor. No node tree is built: that tree
was four fifths of a large file's load time. A document that uses anchors,
aliases, tags, merge keys, duplicate or non-scalar keys is left to the C safe
loader (compose, then construct), which decides what it means, as before.
Only when something is wrong -- a YAML error or a config problem -- is the
text parsed again with the round-trip loader, whose mappings and sequences
remember where each key and item starts (``CommentedMap.lc.key(k)``,
``CommentedSeq.lc.item(i)``, 0-based), to find the lines. (Should the C
parser refuse a document the round-trip loader reads, the round-trip tree is
used for everything.)

How a problem finds its line: every problem carries a *path* -- a tuple of mapping
keys and list indexes such as ``("nodes", 0, "providers", 1, "capacity")`` --
built from cattrs' exception notes or parsed from a ``problems()`` hook's path
string. The line of a path is the line of its deepest part that exists in the
file, so a missing key points at its parent.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from enum import Enum
from itertools import chain, islice
from typing import Any, Literal, TypeVar, cast, final, get_args, get_origin

import cattrs
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
)
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.constructor import ConstructorError, RoundTripConstructor
from ruamel.yaml.cyaml import CBaseLoader
from ruamel.yaml.error import MarkedYAMLError, YAMLError
from ruamel.yaml.events import (
    AliasEvent,
    DocumentStartEvent,
    MappingEndEvent,
    MappingStartEvent,
    ScalarEvent,
    SequenceEndEvent,
    SequenceStartEvent,
)
from ruamel.yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from ruamel.yaml.resolver import VersionedResolver

from ._converter import make_converter

T = TypeVar("T")

Path = tuple[str | int, ...]

_default_converter: cattrs.Converter | None = None


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


def load_config(
    path: str | os.PathLike[str],
    cls: type[T],
    *,
    converter: cattrs.Converter | None = None,
    yields_gil: bool = False,
    pause: Callable[[], None] | None = None,
) -> T:
    """Read the YAML file at ``path`` and structure it into ``cls``.

    Args:
        path: the file; it is named in every error exactly as given.
        cls: a frozen attrs class describing the file.
        converter: defaults to a shared :func:`make_converter` converter.
        yields_gil: never hold the GIL for long, so that an event loop in
            another thread keeps running. The fast path builds no node tree
            and holds the GIL for one parser event at a time; a document the
            safe loader reads (anchors, tags, ...) has its node tree freed a
            node at a time (freed at once, the tree of a 10,000-node file
            holds the GIL for up to 170 ms).
        pause: called every :data:`PAUSE_EVERY` parser events (or tree nodes
            freed): a worker thread's chance to wait while an event loop in
            another thread has work to do.

    Returns:
        The structured, validated object.

    Raises:
        ConfigFileError: the file cannot be read, is not valid YAML, or does
            not match ``cls`` (see :func:`load_config_text`).
    """
    filename = os.fspath(path)
    try:
        with open(filename, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigFileError([f"{filename}: cannot read: {exc.strerror or exc}"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigFileError([f"{filename}: not UTF-8 text: {exc.reason}"]) from None
    return load_config_text(text, cls, filename=filename, converter=converter, yields_gil=yields_gil, pause=pause)


def load_config_text(
    text: str,
    cls: type[T],
    *,
    filename: str = "<config>",
    converter: cattrs.Converter | None = None,
    yields_gil: bool = False,
    pause: Callable[[], None] | None = None,
) -> T:
    """Parse YAML ``text`` and structure it into ``cls``, reporting every problem.

    Unknown keys, missing required keys, wrong types and errors raised by the
    classes themselves (a validator, or ``__attrs_post_init__`` raising
    ``ValueError``; an error with a ``problems`` tuple counts each) are all
    collected. A class may carry a ``config_key_hints: ClassVar[Mapping[str, str]]``
    giving the message for a key it does not accept (used instead of
    "unknown key 'k'"). After structuring, if the object has a method
    ``problems() -> Iterable[tuple[str, str]]`` of ``(path, message)`` pairs,
    each problem is reported the same way; this is where cross-field rules live.

    Raises:
        ConfigFileError: any problem at all; no partial object is returned.
    """
    data, tree = _read(text, filename, release=yields_gil, pause=pause)
    if converter is None:
        converter = _shared_converter()
    found: list[tuple[Path, str]] = []
    try:
        obj = converter.structure(data, cls)
    except Exception as exc:  # every structuring failure is a config problem
        _collect(exc, (), None, found)
    else:
        hook = getattr(obj, "problems", None)
        if callable(hook):
            found.extend((parse_path(where), message) for where, message in hook())
    if found:
        if tree is None:
            tree = _parse(text, filename)
        located = sorted(
            ((_line_of(tree, where), where, message) for where, message in found), key=lambda item: item[0]
        )
        raise ConfigFileError(
            f"{filename}:{line}: {format_path(where)}: {message}" if where else f"{filename}:{line}: {message}"
            for line, where, message in located
        )
    return obj


def _read(text: str, filename: str, *, release: bool, pause: Callable[[], None] | None) -> tuple[Any, Any]:
    """The document's plain data, and its line-keeping tree if it had to be parsed for it.

    Raises:
        ConfigFileError: not a valid YAML document, with the line.
    """
    try:
        return _fast_load(text, release=release, pause=pause), None
    except YAMLError:
        pass
    except Exception as exc:  # ruamel's constructors: a bare ValueError on `!!int abc`, and so on
        raise ConfigFileError([_unreadable(text, filename, exc)]) from None
    tree = _parse(text, filename)  # raises ConfigFileError with the line
    try:
        return _plain(tree), tree
    except TypeError as exc:  # a mapping as a mapping key, which only the round-trip loader reads
        raise ConfigFileError([_unreadable(text, filename, exc)]) from None


def format_path(path: Path) -> str:
    """Render a path as ``nodes[0].providers[1].capacity``."""
    out: list[str] = []
    for part in path:
        if isinstance(part, int):
            out.append(f"[{part}]")
        elif isinstance(part, str) and _PLAIN_KEY.fullmatch(part):
            out.append(f".{part}" if out else part)
        else:
            out.append(f"[{part!r}]")
    return "".join(out)


def parse_path(text: str) -> Path:
    """Parse a path written by :func:`format_path` (or by a ``problems()`` hook)."""
    parts: list[str | int] = []
    for name, index, quoted in _PATH_PART.findall(text):
        if index:
            parts.append(int(index))
        elif quoted:
            parts.append(quoted[1:-1])
        else:
            parts.append(name)
    return tuple(parts)


_PLAIN_KEY = re.compile(r"[A-Za-z0-9_\-]+")
_PATH_PART = re.compile(r"\.?([^.\[\]]+)|\[(\d+)\]|\[('[^']*'|\"[^\"]*\")\]")


def _shared_converter() -> cattrs.Converter:
    global _default_converter
    if _default_converter is None:
        _default_converter = make_converter()
    return _default_converter


class _Yaml12Resolver(VersionedResolver):
    """ruamel.yaml's resolver, YAML 1.2 rules only, remembering each scalar's tag.

    The stock resolver looks up the document's YAML version (through a raised
    and caught ``AttributeError`` with the C parser, which never reports one)
    and scans the rule table for every one of a document's nodes: two thirds
    of a large file's load time. A config file has a few thousand distinct
    scalars (ids, numbers, booleans) repeated over 10,000 nodes, so each
    ``(kind, value, implicit)`` is resolved once per load. Without path
    resolvers (none are registered) ``resolve`` depends on nothing else.
    """

    def __init__(self, version: Any = None, loader: Any = None, loadumper: Any = None) -> None:
        super().__init__(version=version, loader=loader, loadumper=loadumper)
        # By (kind, implicit), then by value: string keys are not tracked by the
        # garbage collector (the loader ends up in a reference cycle with this resolver).
        self._tags: dict[tuple[Any, Any], dict[Any, Any]] = {}

    @property
    def processing_version(self) -> Any:
        return (1, 2)

    def resolve(self, kind: Any, value: Any, implicit: Any) -> Any:
        if self.yaml_path_resolvers:
            return super().resolve(kind, value, implicit)
        by_value = self._tags.get((kind, implicit))
        if by_value is None:
            by_value = self._tags[kind, implicit] = {}
        tag = by_value.get(value)
        if tag is None:
            tag = by_value[value] = super().resolve(kind, value, implicit)
        return tag


def _fast_load(text: str, *, release: bool, pause: Callable[[], None] | None = None) -> Any:
    """Plain Python data of ``text`` by ruamel.yaml's C parser (YAML 1.2).

    The data is built straight from the parser's events (:func:`_plain_document`),
    with no node tree in between. A document that uses anything beyond plain
    mappings, sequences and untagged scalars -- anchors, aliases, tags, merge
    keys, duplicate or non-scalar keys, a second document -- is read again by
    the C safe loader (:func:`_safe_load`), which decides what it means.

    The events are taken from the C parser (``CBaseLoader.get_event``) by a
    C-level iterator, and ``pause`` is called between batches of them: no
    Python generator step per event (a third of the builder's time at
    10,000 nodes).

    ``release``, ``pause``: see :func:`_safe_load`.

    Raises:
        YAMLError: ``text`` is not a single valid YAML document.
    """
    yaml = YAML(typ="safe")
    yaml.Resolver = _Yaml12Resolver
    parser = CBaseLoader(text)
    try:
        return _plain_document(_in_batches(iter(parser.get_event, None), pause), _Scalars(yaml))
    except _NotPlain:
        pass
    finally:
        parser.dispose()
    return _safe_load(text, release=release, pause=pause)


PAUSE_EVERY = 64
"""Parser events (or freed tree nodes) between two calls of a loader's ``pause`` (about 0.1 ms)."""


def _in_batches(items: Iterator[Any], pause: Callable[[], None] | None) -> Iterator[Any]:
    """``items``, calling ``pause`` before each batch of :data:`PAUSE_EVERY` (``items`` itself if None).

    The batches are read ahead of the caller: ``items`` must not depend on what
    the caller does with them.
    """
    if pause is None:
        return items

    def batches() -> Iterator[list[Any]]:
        while batch := list(islice(items, PAUSE_EVERY)):
            pause()
            yield batch

    return chain.from_iterable(batches())


class _NotPlain(Exception):
    """The document uses a YAML feature :func:`_plain_document` leaves to the safe loader."""


_NO_KEY = object()
"""An open mapping's pending key when the next scalar is a key."""


def _plain_document(events: Iterable[Any], scalars: _Scalars) -> Any:
    """The data of a single YAML document from its parser events, as the safe loader builds it.

    Mappings become ``dict`` (in file order), sequences ``list``, scalars what
    ``scalars`` makes of them (looked up here first: most scalars of a large
    file repeat one seen before).

    Raises:
        _NotPlain: the document needs the safe loader (see :func:`_fast_load`).
        YAMLError: from the parser: ``text`` is not valid YAML.
    """
    plain, quoted = scalars.plain, scalars.quoted
    document: list[Any] = []
    top: Any = document  # the innermost open list or dict
    in_mapping = False
    key: Any = _NO_KEY
    stack: list[tuple[Any, bool]] = []
    documents = 0
    for event in events:
        kind = type(event)
        if kind is ScalarEvent:
            if event.anchor is not None or event.tag is not None:
                raise _NotPlain
            implicit = event.implicit
            try:
                value = (plain if implicit[0] else quoted)[event.value]
            except KeyError:
                value = scalars(event.value, implicit)
            if not in_mapping:
                top.append(value)
            elif key is _NO_KEY:
                key = value
            elif key in top:
                raise _NotPlain
            else:
                top[key] = value
                key = _NO_KEY
        elif kind is MappingEndEvent or kind is SequenceEndEvent:
            top, in_mapping = stack.pop()
            key = _NO_KEY
        elif kind is MappingStartEvent or kind is SequenceStartEvent:
            if event.anchor is not None or event.tag is not None:
                raise _NotPlain
            value = {} if kind is MappingStartEvent else []
            if not in_mapping:
                top.append(value)
            elif key is _NO_KEY or key in top:  # a collection as a key, or a duplicate key
                raise _NotPlain
            else:
                top[key] = value
            stack.append((top, in_mapping))
            top, in_mapping, key = value, kind is MappingStartEvent, _NO_KEY
        elif kind is DocumentStartEvent:
            documents += 1
            if documents > 1:
                raise _NotPlain
        elif kind is AliasEvent:
            raise _NotPlain
        # else: stream start and end, document end
    return document[0] if document else None


_PLAIN_TAGS = frozenset(f"tag:yaml.org,2002:{name}" for name in ("null", "bool", "int", "float", "str"))
"""Tags of scalars the event reader builds itself: immutable values, made once per distinct text."""


@final
class _Scalars:
    """Untagged scalars of one document, as the safe loader resolves and constructs them.

    Each distinct ``(value, plain)`` is resolved by :class:`_Yaml12Resolver` and
    constructed by the safe loader's constructor once; the result, an
    immutable value, is shared by every occurrence. Only a plain (unquoted)
    scalar is resolved by the YAML 1.2 rules; any other is a string. The
    resolver answers with a ruamel ``Tag`` whose text is worked out character
    by character on each ``str()``: it is named once per rule, not once per
    value (a 10,000-node file has 10,000 distinct ids).
    """

    def __init__(self, yaml: YAML) -> None:
        self._resolver = yaml.resolver
        self._constructor = yaml.constructor
        self.plain: dict[str, Any] = {}
        """Plain (unquoted) scalars made so far, by their text."""
        self.quoted: dict[str, Any] = {}
        """Quoted scalars made so far, by their text."""
        self._names: dict[Any, str] = {}

    def __call__(self, value: str, implicit: Any) -> Any:
        known = self.plain if implicit[0] else self.quoted
        try:
            return known[value]
        except KeyError:
            pass
        tag = self._resolver.resolve(ScalarNode, value, implicit)
        name = self._name(tag)
        if name not in _PLAIN_TAGS:
            raise _NotPlain
        made = known[value] = self._constructor.construct_non_recursive_object(ScalarNode(tag, value), name)
        return made

    def _name(self, tag: Any) -> str:
        if tag.handle is not None:  # never from the resolver; named in full
            return str(tag)
        name = self._names.get(tag.suffix)
        if name is None:
            name = self._names[tag.suffix] = str(tag)
        return name


def _safe_load(text: str, *, release: bool, pause: Callable[[], None] | None = None) -> Any:
    """Plain Python data of ``text`` by ruamel.yaml's C safe loader (YAML 1.2).

    ``release``: free the node tree a node at a time afterwards (see :func:`_release`),
    calling ``pause`` (if given) every :data:`PAUSE_EVERY` nodes.

    Raises:
        YAMLError: ``text`` is not a single valid YAML document.
    """
    yaml = YAML(typ="safe")
    yaml.Resolver = _Yaml12Resolver
    node = yaml.compose(text)
    if node is None:
        return None
    data = yaml.constructor.construct_document(node)
    if release:
        _release(node, pause)
    return data


def _unreadable(text: str, filename: str, exc: Exception) -> str:
    """``FILE:LINE: YAML error: ...`` for a document ruamel.yaml failed on with a bare exception.

    Its constructors raise ``ValueError`` or ``KeyError`` without a position on
    ``!!int abc`` or ``!!bool maybe`` (the safe and the round-trip loader
    alike), and other bare exceptions on some tagged or anchored mapping keys.
    The line is that of the first explicitly tagged scalar its tag's
    constructor refuses, found from the parser's events; else line 1. The
    value itself is never repeated (it may be a secret).
    """
    yaml = YAML(typ="safe")
    yaml.Resolver = _Yaml12Resolver
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


def _release(root: Any, pause: Callable[[], None] | None = None) -> None:
    """Free a YAML node tree a node at a time, in Python steps.

    Dropping the last reference to a tree of 300,000 objects frees all of them
    in one C call that holds the GIL throughout (170 ms for a 10,000-node
    file on a loaded 2-core box): an event loop in another thread stalls for
    that long. Emptying the containers here, one item per step, frees each
    object when its own last reference goes, and the interpreter may switch
    threads between any two steps.
    """
    stack = [root]
    freed = 0
    while stack:
        item = stack.pop()
        freed += 1
        if pause is not None and freed % PAUSE_EVERY == 0:
            pause()
        children = item.value if isinstance(item, Node) else None
        if isinstance(children, list):
            while children:
                child = children.pop()
                if isinstance(child, tuple):  # a mapping node's (key, value) pair
                    stack.extend(child)
                else:
                    stack.append(child)


class _RoundTripConstructor(RoundTripConstructor):
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


_RoundTripConstructor.add_constructor(None, _RoundTripConstructor.construct_unknown)


def _parse(text: str, filename: str) -> Any:
    yaml = YAML(typ="rt")
    yaml.Constructor = _RoundTripConstructor
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
        raise ConfigFileError([_unreadable(text, filename, exc)]) from None


def _plain(node: Any) -> Any:
    """Copy ruamel's round-trip tree into plain dict/list/str/int/float/bool."""
    if isinstance(node, Mapping):
        return {_plain(k): _plain(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_plain(v) for v in node]
    if isinstance(node, bool) or type(node).__name__ == "ScalarBoolean":
        return bool(node)
    if isinstance(node, int):
        return int(node)
    if isinstance(node, float):
        return float(node)
    if isinstance(node, str):
        return str(node)
    return node


def _line_of(tree: Any, path: Path) -> int:
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


def _collect(exc: BaseException, path: Path, type_: Any, found: list[tuple[Path, str]]) -> None:
    """Flatten cattrs' exception tree into ``(path, message)`` problems."""
    if isinstance(exc, ClassValidationError | IterableValidationError):
        # A class note names an attribute; a list or mapping note an index or key.
        with_notes, without = exc.group_exceptions()
        for sub, note in with_notes:
            part = note.name if isinstance(note, AttributeValidationNote) else note.index
            _collect(sub, (*path, part), note.type, found)
        for sub in without:
            _collect(sub, path, None, found)
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


__all__ = ["ConfigFileError", "format_path", "load_config", "load_config_text", "parse_path"]
