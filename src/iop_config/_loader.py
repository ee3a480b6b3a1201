"""Load a YAML config file into frozen attrs classes, with file:line errors.

Fast first, lines only on error [reload-off-loop]: the file is read by
ruamel.yaml's C parser (``ruamel.yaml.clib``) under YAML 1.2 rules -- the same
rules as the round-trip loader -- and the plain ``dict``/``list``/scalars for
cattrs are built straight from the parser's events, each distinct scalar
resolved and constructed once per file by the safe loader's own resolver
(:class:`Yaml12Resolver`) and constructor. No node tree is built: that tree
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

import os
from typing import Any, TypeVar

import cattrs
from ruamel.yaml.error import YAMLError

from iop_config._fast_yaml import fast_load
from iop_config._positions import (
    ConfigFileError,
    collect_problems,
    format_path,
    line_of,
    parse_path,
    parse_round_trip,
    plain_of,
    unreadable,
)

from ._converter import make_converter

T = TypeVar("T")

Path = tuple[str | int, ...]

_default_converter: cattrs.Converter | None = None


def load_config(
    path: str | os.PathLike[str],
    cls: type[T],
    *,
    converter: cattrs.Converter | None = None,
    yields_gil: bool = False,
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
            node at a time (freed at once, a large file's tree holds the GIL
            throughout). Every :data:`PAUSE_EVERY` parser events (or tree nodes
            freed) it calls :func:`iop_io.yield_to_loop`: in off-loop work
            (:func:`iop_io.run_off_loop`, :func:`iop_io.run_in_turns`), the
            worker's chance to let the event loop run.

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
    return load_config_text(text, cls, filename=filename, converter=converter, yields_gil=yields_gil)


def load_config_text(
    text: str,
    cls: type[T],
    *,
    filename: str = "<config>",
    converter: cattrs.Converter | None = None,
    yields_gil: bool = False,
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
    data, tree = _read(text, filename, release=yields_gil)
    if converter is None:
        converter = _shared_converter()
    found: list[tuple[Path, str]] = []
    try:
        obj = converter.structure(data, cls)
    except Exception as exc:  # every structuring failure is a config problem
        collect_problems(exc, (), None, found)
    else:
        hook = getattr(obj, "problems", None)
        if callable(hook):
            found.extend((parse_path(where), message) for where, message in hook())
    if found:
        if tree is None:
            tree = parse_round_trip(text, filename)
        located = sorted(((line_of(tree, where), where, message) for where, message in found), key=lambda item: item[0])
        raise ConfigFileError(
            f"{filename}:{line}: {format_path(where)}: {message}" if where else f"{filename}:{line}: {message}"
            for line, where, message in located
        )
    return obj


def _read(text: str, filename: str, *, release: bool) -> tuple[Any, Any]:
    """The document's plain data, and its line-keeping tree if it had to be parsed for it.

    Raises:
        ConfigFileError: not a valid YAML document, with the line.
    """
    try:
        return fast_load(text, release=release), None
    except YAMLError:
        pass
    except Exception as exc:  # ruamel's constructors: a bare ValueError on `!!int abc`, and so on
        raise ConfigFileError([unreadable(text, filename, exc)]) from None
    tree = parse_round_trip(text, filename)  # raises ConfigFileError with the line
    try:
        return plain_of(tree), tree
    except TypeError as exc:  # a mapping as a mapping key, which only the round-trip loader reads
        raise ConfigFileError([unreadable(text, filename, exc)]) from None


def _shared_converter() -> cattrs.Converter:
    global _default_converter
    if _default_converter is None:
        _default_converter = make_converter()
    return _default_converter


__all__ = ["ConfigFileError", "format_path", "load_config", "load_config_text", "parse_path"]
