"""The one cattrs converter factory for IOP config files.

Why the converter is stricter than cattrs' defaults: cattrs structures an
``int`` field with ``int(value)``, so ``capacity: "2"`` or ``capacity: 2.7``
would load silently, and a ``list`` field happily iterates a string character
by character. A config file is written by hand, so every scalar must already
have the YAML type the field declares, every list must be a YAML sequence and
every class or mapping a YAML mapping. Each hook raises ``ValueError`` with a
short human message ("must be an integer, got a string"); the loader attaches
file, line and path. Messages never echo the value itself: the value may be a
secret (a token written where a number was expected).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs
import cattrs
from cattrs.cols import is_mapping, is_mutable_sequence, is_sequence, list_structure_factory
from cattrs.gen import make_dict_structure_fn

T = TypeVar("T")


def make_converter() -> cattrs.Converter:
    """Return a new converter for config classes (frozen attrs classes).

    Unknown keys are errors (``forbid_extra_keys=True``), every error of a
    document is collected (detailed validation), scalars are type-strict and
    containers must have the matching YAML shape. Callers may register more
    hooks on the returned converter (e.g. ``configure_tagged_union``).
    """
    converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    converter.register_structure_hook(int, _structure_int)
    converter.register_structure_hook(float, _structure_float)
    converter.register_structure_hook(str, _structure_str)
    converter.register_structure_hook(bool, _structure_bool)
    converter.register_structure_hook_factory(is_sequence, _sequence_hook_factory)
    converter.register_structure_hook_factory(is_mapping, _mapping_hook_factory)
    converter.register_structure_hook_factory(attrs.has, _attrs_hook_factory)
    return converter


_KINDS: tuple[tuple[type, str], ...] = (
    (type(None), "null"),
    (bool, "a boolean"),  # before int: bool is an int subclass
    (int, "an integer"),
    (float, "a float"),
    (str, "a string"),
    (list, "a list"),
    (Mapping, "a mapping"),
)


def yaml_kind(value: object) -> str:
    """Name the YAML kind of a plain value, for messages ("a string", "null", ...)."""
    for kind, name in _KINDS:
        if isinstance(value, kind):
            return name
    return f"a {type(value).__name__}"


def _structure_int(value: object, _: type) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ValueError(f"must be an integer, got {yaml_kind(value)}")


def _structure_float(value: object, _: type) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"must be a number, got {yaml_kind(value)}")


def _structure_str(value: object, _: type) -> str:
    if isinstance(value, str):
        return value
    hint = " (quote it)" if isinstance(value, int | float) else ""
    raise ValueError(f"must be a string, got {yaml_kind(value)}{hint}")


def _structure_bool(value: object, _: type) -> bool:
    if isinstance(value, bool):
        return value
    raise ValueError(f"must be true or false, got {yaml_kind(value)}")


def _guarded(shape: type, noun: str, inner: Callable[[Any, Any], T], exact: type) -> Callable[[Any, Any], T]:
    """``inner``, for a value of ``shape`` only (``exact``: the type loaded data has, checked first:
    ``isinstance`` of an abstract class such as ``Mapping`` costs ten times more)."""

    def structure(value: Any, type_: Any) -> T:
        if type(value) is not exact and not isinstance(value, shape):
            raise ValueError(f"must be {noun}, got {yaml_kind(value)}")
        return inner(value, type_)

    return structure


def _sequence_hook_factory(type_: Any, converter: cattrs.Converter) -> Callable[[Any, Any], Any]:
    as_list = list_structure_factory(type_, converter)
    if is_mutable_sequence(type_):
        return _guarded(list, "a list", as_list, list)
    return _guarded(list, "a list", lambda value, t: tuple(as_list(value, t)), list)


def _mapping_hook_factory(type_: Any, converter: cattrs.Converter) -> Callable[[Any, Any], Any]:
    return _guarded(Mapping, "a mapping", converter.gen_structure_mapping(type_), dict)


def _attrs_hook_factory(type_: Any, converter: cattrs.Converter) -> Callable[[Any, Any], Any]:
    return _guarded(Mapping, "a mapping", make_dict_structure_fn(type_, converter), dict)
