"""The fast read of a YAML file: plain ``dict``/``list``/scalars straight from the C parser's events.

The file is read by ruamel.yaml's C parser (``ruamel.yaml.clib``) under YAML 1.2 rules -- the same
rules as the round-trip loader -- and the plain values for cattrs are built straight from the
parser's events, each distinct scalar resolved and constructed once per file by the safe loader's
own resolver (:class:`Yaml12Resolver`) and constructor. No node tree is built. A document that uses
anchors, aliases, tags, merge keys, duplicate or non-scalar keys is left to the C safe loader
(compose, then construct), which decides what it means.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import chain, islice
from typing import Any, TypeVar, final

from ruamel.yaml import YAML
from ruamel.yaml.cyaml import CBaseLoader
from ruamel.yaml.events import (
    AliasEvent,
    DocumentStartEvent,
    MappingEndEvent,
    MappingStartEvent,
    ScalarEvent,
    SequenceEndEvent,
    SequenceStartEvent,
)
from ruamel.yaml.nodes import Node, ScalarNode
from ruamel.yaml.resolver import VersionedResolver

from iop_io import yield_to_loop

T = TypeVar("T")


class Yaml12Resolver(VersionedResolver):
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


def fast_load(text: str, *, release: bool) -> Any:
    """Plain Python data of ``text`` by ruamel.yaml's C parser (YAML 1.2).

    The data is built straight from the parser's events (:func:`plain_document`),
    with no node tree in between. A document that uses anything beyond plain
    mappings, sequences and untagged scalars -- anchors, aliases, tags, merge
    keys, duplicate or non-scalar keys, a second document -- is read again by
    the C safe loader (:func:`safe_load`), which decides what it means.

    The events are taken from the C parser (``CBaseLoader.get_event``) by a
    C-level iterator, and with ``release`` :func:`iop_io.yield_to_loop` is called between batches of them: no
    Python generator step per event (a third of the builder's time at
    10,000 nodes).

    ``release``: see :func:`safe_load`.

    Raises:
        YAMLError: ``text`` is not a single valid YAML document.
    """
    yaml = YAML(typ="safe")
    yaml.Resolver = Yaml12Resolver
    parser = CBaseLoader(text)
    try:
        return plain_document(in_batches(iter(parser.get_event, None), yields=release), Scalars(yaml))
    except NotPlain:
        pass
    finally:
        parser.dispose()
    return safe_load(text, release=release)


PAUSE_EVERY = 64
"""Parser events (or freed tree nodes) between two calls of :func:`iop_io.yield_to_loop` by a loader that yields."""


def in_batches(items: Iterator[Any], *, yields: bool) -> Iterator[Any]:
    """``items``, calling :func:`iop_io.yield_to_loop` before each batch of :data:`PAUSE_EVERY` when
    ``yields`` (``items`` itself if not).

    The batches are read ahead of the caller: ``items`` must not depend on what
    the caller does with them.
    """
    if not yields:
        return items

    def batches() -> Iterator[list[Any]]:
        while batch := list(islice(items, PAUSE_EVERY)):
            yield_to_loop()
            yield batch

    return chain.from_iterable(batches())


class NotPlain(Exception):
    """The document uses a YAML feature :func:`plain_document` leaves to the safe loader."""


NO_KEY = object()
"""An open mapping's pending key when the next scalar is a key."""


def plain_document(events: Iterable[Any], scalars: Scalars) -> Any:
    """The data of a single YAML document from its parser events, as the safe loader builds it.

    Mappings become ``dict`` (in file order), sequences ``list``, scalars what
    ``scalars`` makes of them (looked up here first: most scalars of a large
    file repeat one seen before). This loop says which events a plain document
    may hold; :class:`_Tree` says where each value goes.

    Raises:
        NotPlain: the document needs the safe loader (see :func:`fast_load`).
        YAMLError: from the parser: ``text`` is not valid YAML.
    """
    plain, quoted = scalars.plain, scalars.quoted
    tree = _Tree()
    add, open_, close = tree.add, tree.open, tree.close
    documents = 0
    for event in events:
        kind = type(event)
        if kind is ScalarEvent:
            if event.anchor is not None or event.tag is not None:
                raise NotPlain
            implicit = event.implicit
            try:
                add((plain if implicit[0] else quoted)[event.value])
            except KeyError:
                add(scalars(event.value, implicit))
        elif kind is MappingEndEvent or kind is SequenceEndEvent:
            close()
        elif kind is MappingStartEvent or kind is SequenceStartEvent:
            if event.anchor is not None or event.tag is not None:
                raise NotPlain
            open_(kind is MappingStartEvent)
        elif kind is DocumentStartEvent:
            documents += 1
            if documents > 1:
                raise NotPlain
        elif kind is AliasEvent:
            raise NotPlain
        # else: stream start and end, document end
    return tree.root()


@final
class _Tree:
    """The document built so far: the open collections, and the key waiting for its value."""

    __slots__ = ("document", "top", "in_mapping", "key", "stack")

    def __init__(self) -> None:
        self.document: list[Any] = []
        self.top: Any = self.document  # the innermost open list or dict
        self.in_mapping = False
        self.key: Any = NO_KEY
        self.stack: list[tuple[Any, bool]] = []

    def add(self, value: Any) -> None:
        """A scalar: the next item of a list, or a mapping's key, or its value (a duplicate key is not plain)."""
        top = self.top
        if not self.in_mapping:
            top.append(value)
        elif self.key is NO_KEY:
            self.key = value
        elif self.key in top:
            raise NotPlain
        else:
            top[self.key] = value
            self.key = NO_KEY

    def open(self, mapping: bool) -> None:
        """A collection starts where a scalar would go (never as a key); it is the innermost until closed."""
        value: Any = {} if mapping else []
        top = self.top
        if not self.in_mapping:
            top.append(value)
        elif self.key is NO_KEY or self.key in top:  # a collection as a key, or a duplicate key
            raise NotPlain
        else:
            top[self.key] = value
        self.stack.append((top, self.in_mapping))
        self.top, self.in_mapping, self.key = value, mapping, NO_KEY

    def close(self) -> None:
        self.top, self.in_mapping = self.stack.pop()
        self.key = NO_KEY

    def root(self) -> Any:
        return self.document[0] if self.document else None


PLAIN_TAGS = frozenset(f"tag:yaml.org,2002:{name}" for name in ("null", "bool", "int", "float", "str"))
"""Tags of scalars the event reader builds itself: immutable values, made once per distinct text."""


@final
class Scalars:
    """Untagged scalars of one document, as the safe loader resolves and constructs them.

    Each distinct ``(value, plain)`` is resolved by :class:`Yaml12Resolver` and
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
        if name not in PLAIN_TAGS:
            raise NotPlain
        made = known[value] = self._constructor.construct_non_recursive_object(ScalarNode(tag, value), name)
        return made

    def _name(self, tag: Any) -> str:
        if tag.handle is not None:  # never from the resolver; named in full
            return str(tag)
        name = self._names.get(tag.suffix)
        if name is None:
            name = self._names[tag.suffix] = str(tag)
        return name


def safe_load(text: str, *, release: bool) -> Any:
    """Plain Python data of ``text`` by ruamel.yaml's C safe loader (YAML 1.2).

    ``release``: free the node tree a node at a time afterwards (see :func:`release_tree`),
    calling :func:`iop_io.yield_to_loop` every :data:`PAUSE_EVERY` nodes.

    Raises:
        YAMLError: ``text`` is not a single valid YAML document.
    """
    yaml = YAML(typ="safe")
    yaml.Resolver = Yaml12Resolver
    node = yaml.compose(text)
    if node is None:
        return None
    data = yaml.constructor.construct_document(node)
    if release:
        release_tree(node)
    return data


def release_tree(root: Any) -> None:
    """Free a YAML node tree a node at a time, in Python steps.

    Dropping the last reference to a large tree frees all of it in one C call
    that holds the GIL throughout: an event loop in another thread stalls for
    that long. Emptying the containers here, one item per step, frees each
    object when its own last reference goes, and the interpreter may switch
    threads between any two steps.
    """
    stack = [root]
    freed = 0
    while stack:
        item = stack.pop()
        freed += 1
        if freed % PAUSE_EVERY == 0:
            yield_to_loop()
        children = item.value if isinstance(item, Node) else None
        if isinstance(children, list):
            while children:
                child = children.pop()
                if isinstance(child, tuple):  # a mapping node's (key, value) pair
                    stack.extend(child)
                else:
                    stack.append(child)
