"""Reading ``edge.yaml``: the cattrs converter and its hooks, and :func:`load_edge_config`.

:func:`load_edge_config` structures the file (every problem reported as ``FILE:LINE: path:
message`` by :mod:`iop_config`), then resolves the secrets the file only names (``token_env``,
``admin_token_env``, ``api_keys_env``) from the environment.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TypeVar

import attrs
import cattrs

from iop_config import load_config, make_converter
from iop_edge._off_loop import yield_to_loop
from iop_edge.config.edge import EdgeConfig
from iop_edge.config.models import EdgeCandidate
from iop_edge.config.schema import (
    ApiKeyDigest,
    EdgeNode,
    EdgeProvider,
    HostPort,
    parse_host_port,
    split_keys,
)

T = TypeVar("T")


def _structure_host_port(value: object, _: type) -> HostPort:
    if not isinstance(value, str):
        raise ValueError("must be a 'host:port' string, e.g. '127.0.0.1:8080'")
    return parse_host_port(value)


def _structure_api_key(value: object, _: type) -> ApiKeyDigest:
    if not isinstance(value, str) or not value:
        raise ValueError("must be a non-empty string")
    return ApiKeyDigest.of(value)


def _edge_converter() -> cattrs.Converter:
    converter = make_converter()
    converter.register_structure_hook(HostPort, _structure_host_port)
    converter.register_structure_hook(ApiKeyDigest, _structure_api_key)
    # Before the hooks that structure it are made (they take the hook registered then):
    converter.register_structure_hook(EdgeProvider, _memoized_hook(converter.get_structure_hook(EdgeProvider)))
    for cls in (EdgeNode, EdgeCandidate):  # one of each per node in a large file
        converter.register_structure_hook(cls, _pausing_hook(converter.get_structure_hook(cls)))
    return converter


MEMO_SIZE = 16384
"""Distinct provider mappings :func:`_memoized_hook` remembers (the oldest is forgotten first)."""


def _memoized_hook(hook: Callable[[object, type[T]], T]) -> Callable[[object, type[T]], T]:
    """``hook`` for a flat mapping of scalars, structured once per distinct mapping.

    [reload-off-loop] A large fleet's nodes mostly list providers written
    alike (``{id: gpu0, capacity: 4, ...}`` on every node): each distinct one
    is structured once and its (frozen) result shared, in one load and from
    one load to the next. The memo is keyed by the mapping's keys, values and
    the values' types, in file order (``1``, ``1.0`` and ``true`` are equal in
    Python, not in a config file), so a hit is what ``hook`` would return;
    a mapping ``hook`` refuses is not remembered, and one holding a list or a
    mapping is structured as usual (never remembered). Thread-safe: two
    loads at once may both structure a mapping, never get a wrong result.
    """
    memo: dict[tuple[tuple[object, ...], tuple[type, ...]], T] = {}

    def memoized(value: object, cls: type[T]) -> T:
        if type(value) is not dict:
            return hook(value, cls)
        key = (tuple(value.items()), tuple(map(type, value.values())))
        try:
            return memo[key]
        except KeyError:
            pass
        except TypeError:  # unhashable: a list or a mapping where a scalar belongs
            return hook(value, cls)
        made = memo[key] = hook(value, cls)
        if len(memo) > MEMO_SIZE:
            memo.pop(next(iter(memo)), None)
        return made

    return memoized


def _pausing_hook(hook: Callable[[object, type[T]], T]) -> Callable[[object, type[T]], T]:
    """``hook``, calling :func:`yield_to_loop` first (structuring runs in a reload's worker thread)."""

    def pausing(value: object, cls: type[T]) -> T:
        yield_to_loop()
        return hook(value, cls)

    return pausing


_CONVERTER = _edge_converter()


def load_edge_config(path: str | os.PathLike[str], *, yields_gil: bool = False) -> EdgeConfig:
    """Load and validate ``edge.yaml``, resolving ``*_env`` secrets from ``os.environ``.

    ``yields_gil``: see :func:`iop_config.load_config` (for a load in a thread beside an event
    loop; the Edge's own reload reads the file in a child process and does not use it).

    Raises:
        iop_config.ConfigFileError: listing every problem as ``FILE:LINE: path: message``.
    """
    config = load_config(path, EdgeConfig, converter=_CONVERTER, yields_gil=yields_gil)
    return _with_environment(config, os.environ)


def _with_environment(config: EdgeConfig, environ: Mapping[str, str]) -> EdgeConfig:
    """Replace each secret the file names by environment variable with its value."""
    nodes = tuple(
        attrs.evolve(node, token=environ.get(node.token_env, "")) if node.token_env is not None else node
        for node in config.nodes
    )
    admin_token = config.admin_token
    if config.admin_token_env is not None:
        admin_token = environ.get(config.admin_token_env, "")
    api_keys = config.api_keys
    if config.api_keys_env is not None:
        api_keys = tuple(ApiKeyDigest.of(key) for key in split_keys(environ.get(config.api_keys_env, "")))
    ui = config.ui
    if ui.viewer_token_env is not None:
        ui = attrs.evolve(ui, viewer_token=environ.get(ui.viewer_token_env, ""))
    ha = config.ha
    if ha is not None and ha.password_env is not None:
        ha = attrs.evolve(ha, password=environ.get(ha.password_env, ""))
    tenant_keys = tuple((digest, tenant.name) for tenant in config.tenants for digest in tenant.key_digests(environ))
    resolved = attrs.evolve(config, nodes=nodes, admin_token=admin_token, api_keys=api_keys, ui=ui, ha=ha)
    object.__setattr__(resolved, "_tenant_keys", tenant_keys)
    object.__setattr__(resolved, "_pool", config._pool)  # no secret is in the pool: it is the same
    return resolved
