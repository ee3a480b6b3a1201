"""``iop status``: the Edge's admission state as a table, once or live.

::

    iop status --edge http://127.0.0.1:8080 [--watch] [--interval 1] [--api-key KEY]

It reads ``GET {edge}/status`` with the model the Edge writes it from
(:mod:`iop_edge.status`) and prints one row per provider and a summary line.
Exit codes: 0 shown (or ``--watch`` ended by Ctrl-C), 1 the Edge is
unreachable, answered other than 200, or sent a document this tool cannot
read (one line on stderr), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import final

import cattrs
import httpx
from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from iop_admission import ProviderSnapshot
from iop_edge.status import EdgeStatus, NodeStatus, parse_status

__all__ = ["EdgeStatus", "NodeStatus", "StatusUnavailable", "fetch_status", "main", "render_status"]

DEFAULT_EDGE = "http://127.0.0.1:8080"


@final
class StatusUnavailable(Exception):
    """The Edge could not be read: unreachable, a non-200 answer, or an unreadable document."""


def fetch_status(client: httpx.Client, edge: str, *, node: str | None = None, model: str | None = None) -> EdgeStatus:
    """GET ``{edge}/status`` (only ``node``'s / ``model``'s part when given) and structure it.

    Raises:
        StatusUnavailable: with a one-line message saying what went wrong.
    """
    url = f"{edge.rstrip('/')}/status"
    params = {name: value for name, value in (("node", node), ("model", model)) if value is not None}
    try:
        response = client.get(url, params=params or None)
    except httpx.HTTPError as exc:
        raise StatusUnavailable(f"cannot reach the Edge at {url}: {exc or type(exc).__name__}") from exc
    if response.status_code != 200:
        raise StatusUnavailable(f"the Edge at {url} answered HTTP {response.status_code}")
    try:
        return parse_status(response.json())
    except (ValueError, TypeError, cattrs.BaseValidationError) as exc:
        if isinstance(exc, cattrs.BaseValidationError):
            detail = "; ".join(cattrs.transform_error(exc))
        else:
            detail = str(exc) or type(exc).__name__
        raise StatusUnavailable(f"unreadable /status document from {url}: {detail}") from exc


def _seconds(value: float) -> str:
    return f"{value:g}s"


def _node_summary(node: NodeStatus) -> str:
    if not node.connected:
        return f"{node.node_id} (disconnected, gen {node.generation})"
    age = "" if node.last_heartbeat_age is None else f", heartbeat {node.last_heartbeat_age:.1f}s ago"
    runs = f", {node.active_runs} run{'' if node.active_runs == 1 else 's'}"
    return f"{node.node_id} (connected, gen {node.generation}{age}{runs})"


_LEGEND = Text(
    "in-flight: live leases/capacity; long: long-context leases/slots; "
    "queued: candidate pressure (a waiter counts at each of its candidates), long ones in ()",
    style="dim",
)
_TOKENS_LEGEND = Text(
    "tokens: reserved/effective budget (of the configured one when the engine's report cut it); "
    "kv: the engine's own KV-cache use; pre: its preemptions since it started",
    style="dim",
)
_STATUS_STYLES = {"available": "green", "unavailable": "red", "disabled": "yellow", "removed": "dim"}


ROWS = 50
"""Providers and nodes listed by name at most; the summary counts them all."""


def _summary(status: EdgeStatus) -> Text:
    """Counts first: readable whatever the fleet size."""
    providers = status.snapshot.providers
    by_status = {name: sum(1 for p in providers if p.status == name) for name in _STATUS_STYLES}
    in_flight = sum(p.in_flight for p in providers)
    revoked = sum(p.revoked_in_flight for p in providers)
    capacity = sum(p.effective_capacity for p in providers)
    connected = sum(1 for n in status.nodes if n.connected)
    # A removed provider is listed only while a lease of it runs: counted only then.
    counts = ", ".join(f"{count} {name}" for name, count in by_status.items() if count or name != "removed")
    running = f" (+{revoked} revoked, still running)" if revoked else ""
    return Text(
        f"providers {len(providers)} ({counts}), in flight {in_flight}/{capacity}{running}; "
        f"nodes {connected}/{len(status.nodes)} connected" + _ha_summary(status)
    )


def _ha_summary(status: EdgeStatus) -> str:
    """``; HA: this Edge leads|stands by, leader X, epoch N since HH:MM:SS`` (empty without ``ha:``)."""
    ha = status.ha
    if ha is None:
        return ""
    role = "this Edge leads" if ha.role == "leader" else "this Edge stands by"
    since = time.strftime(" since %H:%M:%S UTC", time.gmtime(ha.since)) if ha.since is not None else ""
    return f"; HA: {role}, leader {ha.leader or 'none'}, epoch {ha.epoch}{since}"


def render_status(status: EdgeStatus, *, rows: int | None = ROWS) -> Group:
    """The summary, the provider table (``rows`` at most; None: all) and the queue and node lines."""
    snap = status.snapshot
    shown = snap.providers if rows is None else snap.providers[:rows]
    table, tokens = _provider_table(shown)
    queue = Text(
        f"queue {snap.queue_depth}/{snap.max_queue}  timeout {_seconds(snap.queue_timeout)}  "
        f"events dropped {snap.events_dropped}"
    )
    listed = status.nodes if rows is None else status.nodes[:rows]
    more_nodes = len(status.nodes) - len(listed)
    nodes = Text(
        "nodes: "
        + (", ".join(map(_node_summary, listed)) or "none")
        + (f", and {more_nodes} more" if more_nodes else "")
    )
    parts: list[Text | Table] = [_summary(status), table]
    if snap.tenants:
        parts.append(_tenant_table(status))
    hidden = len(snap.providers) - len(shown)
    if hidden:
        parts.append(Text(f"... and {hidden} more providers: narrow with --node / --model, or show --all"))
    if snap.panic:
        parts.append(
            Text("panic mode (every candidate ejected, admitted anyway): " + ", ".join(snap.panic), style="red")
        )
    if status.failures:
        parts.append(_failures(status))
    return Group(*parts, queue, nodes, _LEGEND, *([_TOKENS_LEGEND] if tokens else []))


def _failures(status: EdgeStatus) -> Text:
    """``failed since start: MODEL CLASS N, ...; ...`` ([error-classes]), the classes' own words."""
    per_model = (
        f"{model} " + ", ".join(f"{name} {count}" for name, count in sorted(counts.items()))
        for model, counts in sorted(status.failures.items())
    )
    return Text("failed since start: " + "; ".join(per_model))


def _tenant_table(status: EdgeStatus) -> Table:
    """One row per tenant ([tenant-edge]): band, weight, quotas, queue, leases, share of recent grants, cost."""
    table = Table(title="tenants", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    table.add_column("tenant", overflow="fold")
    for name in ("band", "weight", "waiting", "in-flight", "share", "grants", "charged"):
        table.add_column(name, justify="right", no_wrap=True)
    for t in status.snapshot.tenants:
        table.add_row(
            t.name,
            str(t.priority),
            f"{t.weight:g}",
            f"{t.waiting}/{'-' if t.max_queue is None else t.max_queue}",
            f"{t.in_flight}/{'-' if t.max_in_flight is None else t.max_in_flight}",
            f"{t.share:.0%}",
            str(t.grants),
            f"{t.cost_charged:g}",
        )
    return table


def _provider_table(shown: tuple[ProviderSnapshot, ...]) -> tuple[Table, bool]:
    """The providers' table, and whether it has the tokens column (a budget or an engine's view)."""
    table = Table(
        title="IOP Edge providers",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    table.add_column("node", overflow="fold")
    table.add_column("provider", overflow="fold")
    table.add_column("status", no_wrap=True)
    table.add_column("health", no_wrap=True)
    for name in ("in-flight", "long", "queued", "priority"):
        table.add_column(name, justify="right", no_wrap=True)
    tokens = any(_tokens(p) for p in shown)
    if tokens:
        table.add_column("tokens", justify="right", no_wrap=True)
    for p in shown:
        table.add_row(
            p.node_id,
            p.provider_id,
            Text(p.status, style=_STATUS_STYLES.get(p.status, "")),
            _health(p),
            f"{p.in_flight}/{p.capacity}",
            f"{p.long_in_flight}/{p.long_context_capacity}",
            f"{p.queued} ({p.long_queued})",
            str(p.priority),
            *([_tokens(p) or "-"] if tokens else []),
        )
    return table, tokens


def _tokens(p: ProviderSnapshot) -> str:
    """A token budget's reservations beside the engine's own view ("" when the provider has neither)."""
    parts = []
    budget, effective = p.token_budget, p.effective_token_budget
    if budget is not None and effective is not None:
        parts.append(f"{p.reserved_tokens}/{effective}" + (f" of {budget}" if effective < budget else ""))
    if p.reported_kv_use is not None:
        parts.append(f"kv {100 * p.reported_kv_use:.0f}%")
    if p.reported_preemptions is not None:
        parts.append(f"pre {p.reported_preemptions}")
    return " ".join(parts)


def _health(p: ProviderSnapshot) -> Text:
    """``online`` / ``offline``, or ``ejected`` with the time left and the failure count."""
    if p.health != "ejected":
        return Text(p.health, style="green" if p.health == "online" else "red")
    left = f"{p.ejection_left:.1f}s left" if p.ejection_left > 0 else "probe due"
    return Text(f"ejected ({left}, {p.failures} failures)", style="red")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="iop", description="IOP admission tools.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    status = commands.add_parser("status", help="show the Edge's providers, queue and nodes")
    status.add_argument("--edge", default=DEFAULT_EDGE, help=f"Edge base URL (default {DEFAULT_EDGE})")
    status.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    status.add_argument("--node", help="only this node and its providers")
    status.add_argument("--model", help="only the providers this model key lists, and their nodes")
    status.add_argument("--all", action="store_true", help=f"list every provider and node (default: the first {ROWS})")
    status.add_argument(
        "--interval", type=float, default=1.0, help="seconds between refreshes with --watch (default 1)"
    )
    status.add_argument("--timeout", type=float, default=5.0, help="HTTP timeout in seconds (default 5)")
    status.add_argument(
        "--api-key",
        default=os.environ.get("IOP_API_KEY"),
        help="bearer key, if the Edge requires one (default: $IOP_API_KEY)",
    )
    # Tests end --watch after N refreshes instead of waiting for Ctrl-C.
    status.add_argument("--count", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def main(
    argv: Sequence[str] | None = None,
    *,
    transport: httpx.BaseTransport | None = None,
    console: Console | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Run ``iop``; return the exit code.

    Args:
        argv: arguments without the program name (default ``sys.argv[1:]``).
        transport: HTTP transport for the client (tests pass an
            ``httpx.MockTransport``); default: the network.
        console: where the table goes (default: stdout).
        sleep: how ``--watch`` waits between refreshes.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.interval < 0 or args.timeout <= 0 or (args.count is not None and args.count < 1):
        parser.error("--interval must be >= 0, --timeout > 0 and --count >= 1")
    console = console or Console()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rows = None if args.all else ROWS

    def show() -> Group:
        return render_status(fetch_status(client, args.edge, node=args.node, model=args.model), rows=rows)

    with httpx.Client(transport=transport, timeout=args.timeout, headers=headers) as client:
        try:
            if not args.watch:
                console.print(show())
                return 0
            return _watch(show, args.interval, args.count, console, sleep)
        except StatusUnavailable as exc:
            print(f"iop status: {exc}", file=sys.stderr)
            return 1


def _watch(
    show: Callable[[], Group],
    interval: float,
    count: int | None,
    console: Console,
    sleep: Callable[[float], None],
) -> int:
    """Show the status live, refreshing every ``interval`` seconds, until Ctrl-C (or ``count`` refreshes)."""
    try:
        with Live(show(), console=console, auto_refresh=False) as live:
            shown = 1
            while count is None or shown < count:
                sleep(interval)
                live.update(show(), refresh=True)
                shown += 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
