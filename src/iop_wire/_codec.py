"""JSON codec of the wire protocol: one cattrs converter, built once at import.

Design notes:

- The converter comes from :func:`make_converter` only. Messages are a tagged
  union on ``"type"`` (cattrs ``configure_tagged_union``) — the type is never
  guessed from the shape of the data — and unknown keys are errors
  (``forbid_extra_keys``).
- cattrs' default hooks *convert* (``str(5) == "5"``, ``int("5")``, ``bool("no")``,
  any iterable to a tuple). A protocol must not: the strict hooks below accept
  exactly the JSON type (a bool is not an int, an array is not a string) and raise
  :class:`_WrongJsonType`, whose message is used verbatim in the error reason.
- JSON objects held by messages (``Run.body``) pass through
  without copying in either direction: they are the bulk of every streamed chunk.
- :func:`decode` turns every failure into :class:`ProtocolError`; the reason comes
  from ``cattrs.transform_error`` and names the field (``@ $.providers[0].capacity``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Final, get_args, get_origin

import cattrs
from cattrs.errors import IterableValidationError, IterableValidationNote
from cattrs.gen import make_dict_unstructure_fn, override
from cattrs.strategies import configure_tagged_union
from cattrs.v import format_exception as cattrs_format_exception

from ._errors import CLOSE_TOO_BIG, ProtocolError
from ._messages import MAX_MESSAGE_BYTES, MESSAGE_TYPES, InFlight, Message, ProviderHealth, Run, RunEnd, TunnelRequest

_CLASS_OF_TAG: Final = {tag: cls for cls, tag in MESSAGE_TYPES.items()}

_JSON_TYPE_NAMES: Final = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    type(None): "null",
    list: "array",
    dict: "object",
}


class _WrongJsonType(TypeError):
    """A value has the wrong JSON type; the message is the readable reason."""

    def __init__(self, expected: str, value: object) -> None:
        super().__init__(f"expected {expected}, got {_json_type_name(value)}")


def _json_type_name(value: object) -> str:
    return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


class _WrongArrayLength(ValueError):
    """A fixed-size array (a header pair) has the wrong length."""


def _structure_str(value: object, _: type) -> str:
    if type(value) is not str:
        raise _WrongJsonType("a string", value)
    return value


def _structure_int(value: object, _: type) -> int:
    if type(value) is not int:  # bool is a subclass of int: excluded on purpose
        raise _WrongJsonType("an integer", value)
    return value


def _structure_float(value: object, _: type) -> float:
    # A JSON number: an integer (``1``) or a fraction (``0.5``); never a string or a boolean.
    if type(value) is not float and type(value) is not int:
        raise _WrongJsonType("a number", value)
    return float(value)


def _structure_bool(value: object, _: type) -> bool:
    if type(value) is not bool:
        raise _WrongJsonType("a boolean", value)
    return value


def _is_json_object(cl: Any) -> bool:
    return bool(cl == dict[str, Any])


def _structure_json_object(value: object, _: type) -> dict[str, Any]:
    # json.loads only produces str keys, so the check stops at the container.
    if type(value) is not dict:
        raise _WrongJsonType("an object", value)
    return value


def _is_tuple(cl: Any) -> bool:
    return get_origin(cl) is tuple


def _make_tuple_hook(cl: Any, converter: cattrs.Converter) -> Callable[[object, type], tuple[Any, ...]]:
    """Structure ``tuple[X, ...]`` and ``tuple[X, Y]`` from a JSON array only."""
    args = get_args(cl)
    homogeneous = len(args) == 2 and args[1] is Ellipsis
    item_types: Sequence[Any] = args[:1] if homogeneous else args
    hooks = [converter.get_structure_hook(t) for t in item_types]

    def structure(value: object, _: type) -> tuple[Any, ...]:
        if type(value) is not list and type(value) is not tuple:
            raise _WrongJsonType("an array", value)
        items: Sequence[Any] = value
        if not homogeneous and len(items) != len(item_types):
            raise _WrongArrayLength(f"expected an array of {len(item_types)} items, got {len(items)}")
        result = []
        errors: list[Exception] = []
        for index, item in enumerate(items):
            slot = 0 if homogeneous else index
            try:
                result.append(hooks[slot](item, item_types[slot]))
            except Exception as exc:
                exc.__notes__ = [
                    *getattr(exc, "__notes__", []),
                    IterableValidationNote(f"Structuring {cl} @ index {index}", index, item_types[slot]),
                ]
                errors.append(exc)
        if errors:
            raise IterableValidationError(f"While structuring {cl!r}", errors, cl)
        return tuple(result)

    return structure


def make_converter() -> cattrs.Converter:
    """Build the one converter of the protocol (called once, at import).

    Returns:
        A converter that structures :data:`Message` from decoded JSON strictly and
        unstructures messages to JSON-ready dicts with their ``"type"`` tag.
    """
    converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    converter.register_structure_hook(str, _structure_str)
    converter.register_structure_hook(int, _structure_int)
    converter.register_structure_hook(bool, _structure_bool)
    converter.register_structure_hook(float, _structure_float)
    converter.register_structure_hook_func(_is_json_object, _structure_json_object)
    converter.register_unstructure_hook_func(_is_json_object, lambda value: value)
    converter.register_structure_hook_factory(_is_tuple, _make_tuple_hook)
    # The optional fields are left out of a frame when unset: an older peer, whose strict decoder
    # rejects an unknown key, never sees a field its version lacks (v7's provider_health.engine is
    # set only on v7 connections: iop_wire.health_for takes it out for a v6 peer).
    omitted = override(omit_if_default=True)
    converter.register_unstructure_hook(
        Run,
        make_dict_unstructure_fn(Run, converter, epoch=omitted, long=omitted, model=omitted, deadline_ms=omitted),
    )
    converter.register_unstructure_hook(
        TunnelRequest, make_dict_unstructure_fn(TunnelRequest, converter, epoch=omitted)
    )
    converter.register_unstructure_hook(InFlight, make_dict_unstructure_fn(InFlight, converter, long_runs=omitted))
    converter.register_unstructure_hook(
        ProviderHealth, make_dict_unstructure_fn(ProviderHealth, converter, engine=omitted)
    )
    configure_tagged_union(Message, converter, tag_generator=MESSAGE_TYPES.__getitem__, tag_name="type")
    # The strategy appends the tag after the fields; put it first instead, so a
    # frame in a log or a capture says what it is before it says anything else.
    member_hooks = {cls: converter.get_unstructure_hook(cls) for cls in MESSAGE_TYPES}

    def unstructure_message(message: Message) -> dict[str, Any]:
        cls = type(message)
        return {"type": MESSAGE_TYPES[cls], **member_hooks[cls](message)}

    converter.register_unstructure_hook(Message, unstructure_message)
    return converter


_CONVERTER: Final = make_converter()
_structure_message: Final[Callable[[Any, Any], Message]] = _CONVERTER.get_structure_hook(Message)
_unstructure_message: Final = _CONVERTER.get_unstructure_hook(Message)
_ENCODER: Final = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


_DECODER: Final = json.JSONDecoder(parse_constant=_reject_constant)


def encode(message: Message) -> str:
    """Encode one message as a compact JSON text frame.

    Every field is emitted, optional ones as ``null`` when unset.

    Args:
        message: Any message class of this package.

    Returns:
        The JSON text, with ``"type"`` set to the message's tag.

    Raises:
        TypeError: ``message`` is not a wire message, or a JSON object it holds
            contains a value JSON cannot represent.
        ValueError: a JSON object it holds contains NaN or infinity.
    """
    if type(message) is RunEnd and _plain_ok_end(message):
        return _OK_END_HEAD + _ENCODER.encode(message.run_id) + _OK_END_TAIL
    if type(message) not in MESSAGE_TYPES:
        raise TypeError(f"encode() expects a wire message, got {type(message).__name__}")
    return _ENCODER.encode(_unstructure_message(message))


_BODY_SLOT: Final = ',"body":{},'
"""Where an empty body sits in an encoded ``run`` (no string value holds an unescaped ``"``)."""


def encode_run(run: Run, body_json: str) -> str:
    """A ``run`` frame carrying ``body_json`` as its body, character for character (v5).

    ``body_json`` is the text of a JSON object: the client's own body, which the Edge has
    read and checked but does not rebuild, so the frame is the body plus the run's other
    fields, never larger (numbers keep their spelling, escapes stay escapes). ``run.body``
    must be empty: this puts ``body_json`` in its place.

    Raises:
        ValueError: ``run.body`` is not empty.
    """
    if run.body:
        raise ValueError("encode_run() puts body_json in place of run.body: give an empty body")
    head, tail = encode(run).split(_BODY_SLOT, 1)
    return f'{head},"body":{body_json},{tail}'


def _plain_ok_end(end: RunEnd) -> bool:
    """Whether ``end`` is a run's plain ``ok`` end (every answered run has one): :func:`encode`
    writes it from a template around its run id, without the converter (cheaper per run)."""
    return (
        end.status == "ok"
        and end.code is None
        and end.message is None
        and end.upstream_status is None
        and end.upstream_body is None
    )


_OK_END_HEAD, _OK_END_TAIL = _ENCODER.encode(_unstructure_message(RunEnd("\0", "ok"))).split('"\\u0000"')


_RUN_KEYS: Final = frozenset(("type", "run_id", "provider", "endpoint", "body", "stream"))
_RUN_OPTIONAL_KEYS: Final = frozenset(("epoch", "long", "model", "deadline_ms"))


def _plain_run(obj: dict[str, Any]) -> Run | None:
    """A ``run`` frame whose fields are exactly the ones of :class:`Run`, each of its JSON
    type and value, built without the converter; None for anything else (the converter
    then structures it, or says what is wrong).

    Every run a node serves is decoded: this costs about a third of the converter's time.
    """
    keys = obj.keys()
    epoch, long, model, deadline_ms = None, False, None, None
    if keys != _RUN_KEYS:
        if not keys - _RUN_KEYS <= _RUN_OPTIONAL_KEYS or not keys >= _RUN_KEYS:
            return None
        epoch, long, model, deadline_ms = (
            obj.get("epoch"),
            obj.get("long", False),
            obj.get("model"),
            obj.get("deadline_ms"),
        )
        if (epoch is not None and type(epoch) is not int) or type(long) is not bool:
            return None
        if (model is not None and type(model) is not str) or (deadline_ms is not None and type(deadline_ms) is not int):
            return None
    run_id, provider, endpoint, body, stream = (
        obj["run_id"],
        obj["provider"],
        obj["endpoint"],
        obj["body"],
        obj["stream"],
    )
    if type(run_id) is not str or type(provider) is not str or type(endpoint) is not str:
        return None
    if type(body) is not dict or type(stream) is not bool:
        return None
    try:
        return Run(run_id, provider, endpoint, body, stream, epoch, long, model, deadline_ms)
    except ValueError:  # a value rule (the endpoint): the converter's reason names it
        return None


def _format_exception(exc: BaseException, type_: type | None) -> str:
    if isinstance(exc, (_WrongJsonType, _WrongArrayLength)):
        return str(exc)
    if isinstance(exc, ValueError) and type_ is None:
        # Raised by a message validator (value rules); its text names the field.
        return str(exc)
    return cattrs_format_exception(exc, type_)


def _problems(exc: Exception) -> str:
    try:
        return "; ".join(cattrs.transform_error(exc, format_exception=_format_exception))
    except Exception:  # an error shape transform_error does not know: still readable
        return f"{type(exc).__name__}: {exc}"


def decode(data: str | bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """Decode one frame into a message.

    Checks, in order: size (UTF-8 bytes), UTF-8 (for ``bytes``), JSON syntax,
    a JSON object, a known ``"type"``, then every field (required, no extra keys,
    exact JSON types) and the value rules of the message class.

    Args:
        data: One WebSocket frame.
        max_bytes: The largest frame accepted, in UTF-8 bytes.

    Returns:
        The message.

    Raises:
        ProtocolError: The frame is not a valid message; ``reason`` says why and
            names the field, ``close_code`` is 1009 when too large, else 1002.
            No other exception escapes.
    """
    size = len(data)
    if isinstance(data, str) and size * 4 > max_bytes:
        # UTF-8 needs 1 to 4 bytes per code point: only measure when it can matter.
        size = len(data.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise ProtocolError(f"message too large: {size} bytes > {max_bytes}", close_code=CLOSE_TOO_BIG)
    try:
        text = data if isinstance(data, str) else bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"frame is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    try:
        obj = _DECODER.decode(text)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"malformed JSON: {exc}") from None
    if type(obj) is not dict:
        raise ProtocolError(f"expected a JSON object, got {_json_type_name(obj)}")
    if "type" not in obj:
        raise ProtocolError("missing message type (field 'type')")
    tag = obj["type"]
    if type(tag) is not str or tag not in _CLASS_OF_TAG:
        shown = repr(tag) if len(repr(tag)) <= 40 else repr(tag)[:37] + "..."
        raise ProtocolError(f"unknown message type {shown} (field 'type')")
    if tag == "run" and (run := _plain_run(obj)) is not None:
        return run
    try:
        return _structure_message(obj, Message)
    except Exception as exc:
        raise ProtocolError(f"invalid {tag} message: {_problems(exc)}") from None
