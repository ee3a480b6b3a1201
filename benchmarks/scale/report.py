"""The scale benchmark's Markdown tables, from :func:`benchmarks.scale.run`'s result."""

from __future__ import annotations

from typing import Any

from .fleet import FLEET_NICENESS, RECOVERY_MARKS, STORM_TIMEOUT


def _fmt(value: float | None, unit: str = "", digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}{unit}"


def table(result: dict[str, Any]) -> str:
    """Format :func:`run`'s result as Markdown tables (the issue's figures, then the CPU behind them,
    then the reload stall taken apart; with ``reload_only``, the storm and ``/status``, then the stalls)."""
    if result.get("reload_only"):
        lines = _reload_only_table(result["rows"])
    else:
        lines = _load_tables(result["rows"])
    lines += _reload_table(result["rows"])
    if result.get("edge_config"):
        lines += ["", "edge.yaml also set: " + ", ".join(f"`{line}`" for line in result["edge_config"])]
    if "loadavg_before" in result:
        before, after = result["loadavg_before"], result["loadavg_after"]
        lines += ["", f"load average before {before[0]:.1f}, after {after[0]:.1f} (1 min)"]
    if "cpus_awake" in result:
        held = "held awake" if result["cpus_awake"] else "not held awake (no PM QoS here)"
        lines += ["", f"CPUs {held} (benchmarks/awake.py); the fleet but node-0 at nice {FLEET_NICENESS}"]
    return "\n".join(lines)


def _load_tables(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| nodes | wire | registration storm | Edge start | RSS | `/status` (all / `?node=`) | `/metrics` "
        "| requests/s, 1 / all candidates | reload: largest stream gap (same stream, no reload) "
        "| after a restart: registered at 5 / 15 / 30 s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rec = r["recovery"]
        shares = " / ".join(f"{rec[f'share_{m:g}s']:.1%}" for m in RECOVERY_MARKS)
        storm = (
            _fmt(r["storm_s"], " s")
            if r["storm_s"] is not None
            else f"{r['storm_registered']:,} in {STORM_TIMEOUT:.0f} s"
        )
        lines.append(
            f"| {r['nodes']:,} | v{r['wire']} | {storm} | {_fmt(r['edge_start_s'], ' s')} "
            f"| {r['rss_mb']:.0f} MB | {r['status_ms']:.0f} ms, {r['status_bytes'] / 1e6:.2f} MB / {r['status_node_ms']:.0f} ms "
            f"| {r['metrics_ms']:.0f} ms, {r['metrics_bytes'] / 1e6:.2f} MB, {r['metrics_series']:,} series "
            f"| {r['one']['rps']:,.0f} / {r['all']['rps']:,.0f} "
            f"| {r['reload']['reload_max_gap_ms']:.0f} ms ({r['reload']['baseline_max_gap_ms']:.0f} ms) "
            f"| {shares} (all: {_fmt(rec['all_back_s'], ' s')}; Edge start {rec['edge_start_s']:.1f} s) |"
        )
    lines += [
        "",
        "| nodes | wire | Edge CPU per registration (storm) | refused at accept (storm / restart) "
        "| CPU share with no requests (heartbeats): Edge / fleet | `/healthz` during the restart storm: p50 / max "
        "| Edge CPU per request, 1 / all | Edge CPU share, 1 / all | fleet CPU share, 1 / all | fleet loop lag, 1 / all "
        "| Edge full GCs: storm (longest) / under load 1 + all |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        one, every = r["one"], r["all"]
        gc_count, gc_s, gc_long = r["storm_edge_gc2"]
        refused = sum(r["storm_pending_closed"].get(k, 0) for k in ("max_pending", "max_pending_per_source"))
        refused_restart = sum(
            r["recovery"]["pending_closed"].get(k, 0) for k in ("max_pending", "max_pending_per_source")
        )
        lines.append(
            f"| {r['nodes']:,} | v{r['wire']} | {r['storm_edge_cpu_s'] / max(1, r['storm_registered']) * 1e6:,.0f} µs "
            f"| {refused:,.0f} / {refused_restart:,.0f} "
            f"| {r['edge_idle_cpu_share']:.0%} / {r['fleet_idle_cpu_share']:.0%} "
            f"| {r['recovery']['healthz_p50_ms']:.1f} / {r['recovery']['healthz_max_ms']:.0f} ms "
            f"| {one['edge_cpu_us_per_request']:,.0f} / {every['edge_cpu_us_per_request']:,.0f} µs "
            f"| {one['edge_cpu_share']:.0%} / {every['edge_cpu_share']:.0%} "
            f"| {one['fleet_cpu_share']:.0%} / {every['fleet_cpu_share']:.0%} "
            f"| {one['fleet_max_lag_ms']:.0f} / {every['fleet_max_lag_ms']:.0f} ms "
            f"| {gc_count} in {gc_s:.2f} s ({gc_long * 1000:.0f} ms) / "
            f"{one['edge_gc2'] + every['edge_gc2']} in {one['edge_gc2_s'] + every['edge_gc2_s']:.2f} s |"
        )
    return lines


def _reload_only_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| nodes | wire | registration storm | Edge start | RSS | `/status` (all / `?node=`) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        storm = _fmt(r["storm_s"], " s") if r["storm_s"] is not None else f"{r['storm_registered']:,} registered"
        lines.append(
            f"| {r['nodes']:,} | v{r['wire']} | {storm} | {_fmt(r['edge_start_s'], ' s')} | {r['rss_mb']:.0f} MB "
            f"| {r['status_ms']:.0f} ms, {r['status_bytes'] / 1e6:.2f} MB / {r['status_node_ms']:.0f} ms |"
        )
    return lines


def _reload_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "",
        "| nodes | wire | stream's largest gap: no reload / idle spinner / reload (when the reload's fell, of the window) "
        "| Edge loop's longest batch (task, steps): "
        "no reload / reload | the largest gap taken apart, no reload / reload: node-0's own gap "
        "[node-0's largest anywhere in the window], "
        "transit of the later event (of the earlier), Edge loop's longest hold inside it (its CPU) "
        "| Edge loop in the window, no reload / reload: in batches, its CPU, waited in batches "
        "(GIL or CPU), waited for a CPU anywhere "
        "| the reload's steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for rel in r["reloads"]:
            lines.append(
                f"| {r['nodes']:,} | v{r['wire']} "
                f"| {rel['baseline_max_gap_ms']:.1f} / {_fmt(rel.get('spinner_max_gap_ms'))} "
                f"/ {rel['reload_max_gap_ms']:.1f} ms {_when(rel)} "
                f"| {_hold(rel, 'baseline')} / {_hold(rel, 'reload')} "
                f"| {_apart(rel['baseline_largest'])} / {_apart(rel['reload_largest'])} "
                f"| {_loop_split(rel['baseline_loop_time'])} / {_loop_split(rel['reload_loop_time'])} "
                f"| {rel['steps'] or 'not applied'} |"
            )
    return lines


def _when(reload: dict[str, Any]) -> str:
    """When the reload's largest gap ended, of its window (and whether a stream ended before its window did)."""
    at = reload["reload_largest"]["at_ms"]
    short = [key for key in ("baseline", "spinner", "reload") if not reload.get(f"{key}_covered", True)]
    return f"({_fmt(at and at / 1000, ' s')} of {reload.get('window_s', 0):.1f} s" + (
        f"; {' and '.join(short)} stream ended early)" if short else ")"
    )


def _apart(largest: dict[str, Any]) -> str:
    task = largest["loop_task"].rsplit(".", 1)[-1] or "none"
    return (
        f"{_fmt(largest['sent_ms'], ' ms')} [{_fmt(largest['sent_max_ms'], ' ms')}], "
        f"{_fmt(largest['transit_ms'], ' ms')} "
        f"({_fmt(largest['transit_before_ms'], ' ms')}), {largest['loop_ms']:.1f} ms {task} "
        f"({largest['loop_cpu_ms']:.1f} ms)"
    )


def _loop_split(spent: dict[str, float]) -> str:
    return f"{spent['busy_ms']:.0f}, {spent['cpu_ms']:.0f}, {spent['waited_ms']:.0f}, {spent['runq_ms']:.0f} ms"


def _hold(reload: dict[str, Any], key: str) -> str:
    task = reload[f"{key}_loop_max_task"].rsplit(".", 1)[-1]
    return f"{reload[f'{key}_loop_max_ms']:.1f} ms ({task}, {reload[f'{key}_loop_max_steps']})"
