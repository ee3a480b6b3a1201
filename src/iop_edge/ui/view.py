"""The queue page's view model ([queue-page]): one admission snapshot -> one JSON-able view.

Pure: no I/O, no clock, no trio. The Edge takes :meth:`Admission.snapshot` and
:meth:`Admission.waiters` in one synchronous step and hands both here, so every
count, position and reason on the page comes from the state admission decides on.

A large fleet is aggregated, never sent whole: totals by health over every
provider, then at most ``ViewLimits.providers`` provider rows and
``ViewLimits.waiters`` waiter rows after the filters, with the number left out.
Prompts never reach this module (a waiter snapshot holds none); API keys and
tokens are not part of its inputs. Tenants appear by name only, and only when
the snapshot has tenant rows (``PoolConfig.tenants`` configured): otherwise the
view's ``tenants`` is empty and every waiter's tenant is ``default``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, final

import attrs

from iop_admission import ModelGroup, ProviderKey, ProviderSnapshot, Snapshot, TenantSnapshot, WaiterSnapshot
from iop_io import yield_to_loop

REASONS: Mapping[str, str] = {
    "no_live_candidate": "no candidate is online (offline, ejected, unavailable or disabled)",
    "tenant_quota": "its tenant is at its max_in_flight quota",
    "higher_band_ahead": "a higher band waits for the same providers, served first",
    "all_candidates_full": "every live candidate is at capacity",
    "long_slot_taken": "a long-context request: every live candidate's long-context slots are taken",
    "earlier_request_first": "a candidate has room; an earlier request is granted first",
}
"""Why a request waits, by code, as the page explains it: the first of these that applies,
in this order (:func:`wait_reason`). ``tenant_quota`` and ``higher_band_ahead`` need
tenants (``Snapshot.tenants``); without them they never apply."""

TENANT_REASONS = frozenset(("tenant_quota", "higher_band_ahead"))
"""The reasons that need tenants: left out of a view's ``reasons`` when there are none."""

_PAUSE_EVERY = 2000  # waiters between two calls of ``yield_to_loop``


@final
@attrs.frozen(kw_only=True)
class ViewLimits:
    """At most this many rows of each table in one view."""

    providers: int = 200
    waiters: int = 100
    candidates: int = 8


@final
@attrs.frozen(kw_only=True)
class ViewFilter:
    """What the viewer asked to see: a node id substring, a model key, a health, a tenant
    (the tenant filter applies to the waiters only)."""

    node: str = ""
    model: str = ""
    health: str = ""
    tenant: str = ""

    def keeps(self, p: ProviderSnapshot, models_of: Mapping[ProviderKey, frozenset[str]]) -> bool:
        if self.node and self.node not in p.node_id:
            return False
        if self.health and self.health != health_of(p):
            return False
        return not self.model or self.model in models_of.get(ProviderKey(p.node_id, p.provider_id), frozenset())


def health_of(p: ProviderSnapshot) -> str:
    """``online``, ``offline``, ``ejected``, ``unavailable`` (the node says so) or ``disabled``."""
    if p.status == "disabled":
        return "disabled"
    if p.health == "online" and p.status == "unavailable":
        return "unavailable"
    return p.health


def wait_reason(
    candidates: Iterable[ProviderSnapshot],
    long: bool,
    *,
    tenant: TenantSnapshot | None = None,
    higher_band_ahead: bool = False,
) -> str:
    """Why a request of this kind waits for these candidates (a code of :data:`REASONS`).

    ``tenant``: its tenant's row (None without tenants); ``higher_band_ahead``: a waiter
    of a higher priority band, whose tenant is under its quota, may use one of these
    candidates.
    """
    live = [p for p in candidates if health_of(p) == "online" and p.effective_capacity > 0]
    if not live:
        return "no_live_candidate"
    if tenant is not None and tenant.max_in_flight is not None and tenant.in_flight >= tenant.max_in_flight:
        return "tenant_quota"
    if higher_band_ahead:
        return "higher_band_ahead"
    with_room = [p for p in live if p.in_flight < p.effective_capacity]
    if not with_room:
        return "all_candidates_full"
    if long and all(p.long_in_flight >= p.effective_long_capacity for p in with_room):
        return "long_slot_taken"
    return "earlier_request_first"


def build_view(
    snapshot: Snapshot,
    waiters: tuple[WaiterSnapshot, ...],
    models: Mapping[str, ModelGroup],
    *,
    wanted: ViewFilter = ViewFilter(),
    limits: ViewLimits = ViewLimits(),
) -> dict[str, Any]:
    """The page's view of one instant: totals, providers, model keys, waiters and why they wait.

    Calls :func:`iop_io.yield_to_loop` every few thousand items (the Edge builds the view in a
    worker thread: :func:`iop_io.run_off_loop`).
    """
    by_key = {ProviderKey(p.node_id, p.provider_id): p for p in snapshot.providers}
    models_of: dict[ProviderKey, set[str]] = {}
    for name, group in models.items():
        for key in group.candidates:
            models_of.setdefault(key, set()).add(name)
    frozen_models = {key: frozenset(names) for key, names in models_of.items()}
    tenants = {t.name: t for t in snapshot.tenants}
    top_band = _top_band(waiters, tenants) if tenants else {}
    # Waiters of one model key share one candidate tuple: the reason is worked out once per
    # tuple, kind and tenant.
    reasons: dict[tuple[int, bool, str], str] = {}

    def reason(w: WaiterSnapshot) -> str:
        kind = (id(w.candidates), w.long, w.tenant)
        found = reasons.get(kind)
        if found is None:
            tenant = tenants.get(w.tenant)
            band = tenant.priority if tenant is not None else 0
            found = reasons[kind] = wait_reason(
                (by_key[k] for k in w.candidates if k in by_key),
                w.long,
                tenant=tenant,
                higher_band_ahead=any(top_band.get(k, band) > band for k in w.candidates),
            )
        return found

    waiting, oldest = _waiting_by_model(waiters)
    totals = _totals(snapshot)
    yield_to_loop()
    providers = _providers(snapshot, frozen_models, wanted, limits)
    yield_to_loop()
    return {
        "totals": totals,
        "providers": providers,
        "models": _models(models, waiting, oldest, by_key, wanted, limits),
        "waiters": _waiters(waiters, reason, wanted, limits),
        "tenants": [_tenant_row(t) for t in snapshot.tenants],
        "reasons": {code: text for code, text in REASONS.items() if tenants or code not in TENANT_REASONS},
        "panic": list(snapshot.panic),
    }


def _top_band(waiters: tuple[WaiterSnapshot, ...], tenants: Mapping[str, TenantSnapshot]) -> dict[ProviderKey, int]:
    """Per provider: the highest band among the waiters that may use it and whose tenant is
    under its ``max_in_flight`` (a waiter held by its own quota is ahead of nobody)."""
    by_tuple: dict[int, tuple[tuple[ProviderKey, ...], int]] = {}
    for i, w in enumerate(waiters):
        if not i % _PAUSE_EVERY:
            yield_to_loop()
        tenant = tenants.get(w.tenant)
        if tenant is None or (tenant.max_in_flight is not None and tenant.in_flight >= tenant.max_in_flight):
            continue
        seen = by_tuple.get(id(w.candidates))
        if seen is None or tenant.priority > seen[1]:
            by_tuple[id(w.candidates)] = (w.candidates, tenant.priority)
    top: dict[ProviderKey, int] = {}
    for candidates, band in by_tuple.values():
        for key in candidates:
            if band > top.get(key, band - 1):
                top[key] = band
    return top


def _tenant_row(t: TenantSnapshot) -> dict[str, Any]:
    return {
        "tenant": t.name,
        "band": t.priority,
        "weight": t.weight,
        "waiting": t.waiting,
        "in_flight": t.in_flight,
        "max_in_flight": t.max_in_flight,
        "max_queue": t.max_queue,
        "share": round(t.share, 3),
        "grants": t.grants,
    }


def _totals(snapshot: Snapshot) -> dict[str, Any]:
    health: dict[str, int] = dict.fromkeys(("online", "offline", "ejected", "unavailable", "disabled"), 0)
    in_flight = capacity = 0
    nodes: set[str] = set()
    connected: set[str] = set()
    for p in snapshot.providers:
        health[health_of(p)] += 1
        in_flight += p.in_flight
        capacity += p.effective_capacity
        nodes.add(p.node_id)
        if p.connected:
            connected.add(p.node_id)
    return {
        "queue_depth": snapshot.queue_depth,
        "max_queue": snapshot.max_queue,
        "queue_timeout": snapshot.queue_timeout,
        "providers": len(snapshot.providers),
        "in_flight": in_flight,
        "capacity": capacity,
        "health": health,
        "nodes": len(nodes),
        "offline_nodes": len(nodes) - len(connected),
    }


def _providers(
    snapshot: Snapshot,
    models_of: Mapping[ProviderKey, frozenset[str]],
    wanted: ViewFilter,
    limits: ViewLimits,
) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    matched = 0
    for p in snapshot.providers:
        if not wanted.keeps(p, models_of):
            continue
        matched += 1
        if len(rows) < limits.providers:
            rows.append(
                {
                    "node": p.node_id,
                    "provider": p.provider_id,
                    "health": health_of(p),
                    "ejection_left": round(p.ejection_left, 1),
                    "reported": p.reported,
                    "report_reason": p.report_reason,
                    "capacity": p.capacity,
                    "reported_capacity": p.reported_capacity,
                    "token_budget": p.token_budget,
                    "effective_token_budget": p.effective_token_budget,
                    "reserved_tokens": p.reserved_tokens,
                    "kv_use": p.reported_kv_use,
                    "preemptions": p.reported_preemptions,
                    "in_flight": p.in_flight,
                    "long_capacity": p.long_context_capacity,
                    "long_in_flight": p.long_in_flight,
                    "pressure": p.queued,
                    "long_pressure": p.long_queued,
                }
            )
    return {"rows": rows, "matched": matched, "left_out": matched - len(rows)}


def _waiting_by_model(waiters: tuple[WaiterSnapshot, ...]) -> tuple[dict[str, list[int]], dict[str, float]]:
    """Per model key: ``[normal, long]`` waiting, and the oldest wait."""
    waiting: dict[str, list[int]] = {}
    oldest: dict[str, float] = {}
    for i, w in enumerate(waiters):
        if not i % _PAUSE_EVERY:
            yield_to_loop()
        counts = waiting.get(w.model)
        if counts is None:
            counts = waiting[w.model] = [0, 0]
            oldest[w.model] = w.age
        elif w.age > oldest[w.model]:  # a retry queued later may have waited longer
            oldest[w.model] = w.age
        counts[w.long] += 1
    return waiting, oldest


def _models(
    models: Mapping[str, ModelGroup],
    waiting: Mapping[str, list[int]],
    oldest: Mapping[str, float],
    by_key: Mapping[ProviderKey, ProviderSnapshot],
    wanted: ViewFilter,
    limits: ViewLimits,
) -> list[dict[str, Any]]:
    rows = []
    for name, group in models.items():
        if wanted.model and name != wanted.model:
            continue
        keys = group.candidates
        counts = waiting.get(name, [0, 0])
        rows.append(
            {
                "model": name,
                "waiting": counts[0] + counts[1],
                "long_waiting": counts[1],
                "oldest_wait": round(oldest.get(name, 0.0), 1),
                "in_flight": sum(by_key[k].in_flight for k in keys if k in by_key),
                "candidates": [str(k) for k in keys[: limits.candidates]],
                "candidate_count": len(keys),
                "live_candidates": sum(1 for k in keys if k in by_key and health_of(by_key[k]) == "online"),
            }
        )
    return rows


def _waiters(
    waiters: tuple[WaiterSnapshot, ...],
    reason: Callable[[WaiterSnapshot], str],
    wanted: ViewFilter,
    limits: ViewLimits,
) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    # Waiters counted per candidate tuple, kind and tenant (one reason each), a sample of each kept.
    kinds: dict[tuple[int, bool, str], list[Any]] = {}
    on_node: dict[int, bool] = {}  # by candidate tuple, shared by the waiters of a model key
    matched = 0
    for i, w in enumerate(waiters):
        if not i % _PAUSE_EVERY:
            yield_to_loop()
        if wanted.model and w.model != wanted.model:
            continue
        if wanted.tenant and w.tenant != wanted.tenant:
            continue
        if wanted.node:
            near = on_node.get(id(w.candidates))
            if near is None:
                near = on_node[id(w.candidates)] = any(wanted.node in k.node_id for k in w.candidates)
            if not near:
                continue
        matched += 1
        kind = kinds.get((id(w.candidates), w.long, w.tenant))
        if kind is None:
            kinds[id(w.candidates), w.long, w.tenant] = [w, 1]
        else:
            kind[1] += 1
        if len(rows) < limits.waiters:
            rows.append(
                {
                    "order": w.order,
                    "position": w.position,
                    "model": w.model,
                    "long": w.long,
                    "age": round(w.age, 1),
                    "attempt": w.attempt,
                    "tenant": w.tenant,
                    "reason": reason(w),
                }
            )
    counts: dict[str, int] = {}
    for sample, count in kinds.values():
        why = reason(sample)
        counts[why] = counts.get(why, 0) + count
    return {"rows": rows, "matched": matched, "left_out": matched - len(rows), "by_reason": counts}
