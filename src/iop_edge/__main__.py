"""``iop-edge --config edge.yaml``: the Edge daemon.

SIGHUP re-reads the config file and applies it (a rejected file keeps the old
config and logs every error). SIGINT/SIGTERM (and SIGBREAK on Windows) close
every node connection and stop. Exit codes: 0 after a shutdown signal, 2 when
the config cannot be loaded (every problem on stderr, one per line).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Sequence
from typing import Final

import trio

from iop_config import (
    ConfigFileError,
    daemon_arguments,
    reload_signals,
    report_config_problems,
    shutdown_signals,
    tune_collector,
)
from iop_edge._service import EdgeService, load_config_off_loop

logger = logging.getLogger("iop_edge")

EXIT_OK = 0
YOUNG_THRESHOLD: Final = 50_000
"""The Edge's young-generation threshold (:func:`iop_config.tune_collector`; CPython's default: 700).

At fleet size the Edge holds millions of long-lived objects (the parsed config, the pool, each
node's connection) and the objects of each pending connection and queued request: with the default
policy, full collections came again and again, letting connections miss their registration
deadline [reconnect-storm]. Nothing is frozen: the config is replaced on reload.
"""


async def serve_edge(service: EdgeService) -> int:
    """Serve until a shutdown signal (:func:`iop_config.shutdown_signals`); reload on SIGHUP.
    Returns the exit code."""
    reload = reload_signals()
    with trio.open_signal_receiver(*shutdown_signals(), *reload) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(service.serve)
            async for signum in signals:
                if signum in reload:
                    # In its own task: the loop keeps serving, and a SIGTERM is not
                    # held up by a reload (the service serializes reloads).
                    logger.info("SIGHUP: reloading %s", service.config_path)
                    nursery.start_soon(service.reload)
                    continue
                logger.info("%s received, shutting down", signal.Signals(signum).name)
                await service.registry.aclose_all()
                nursery.cancel_scope.cancel()
                break
    return EXIT_OK


def main(argv: Sequence[str] | None = None, *, instruments: Sequence[trio.abc.Instrument] = ()) -> None:
    """Console entry point of ``iop-edge``.

    ``instruments``: trio instruments for the Edge's run (benchmarks time the loop with them).
    """
    args = daemon_arguments(
        "iop-edge", "IOP Edge: OpenAI-compatible gateway with provider-wide admission.", "path to edge.yaml", argv
    )
    tune_collector(YOUNG_THRESHOLD, freeze=False)
    raise SystemExit(trio.run(start_edge, args.config, instruments=instruments))


async def start_edge(config_path: str) -> int:
    """Load the config (in a worker thread) and serve it; the exit code."""
    try:
        config = await load_config_off_loop(config_path)
    except (ConfigFileError, OSError) as exc:
        return report_config_problems(config_path, exc)
    try:
        service = EdgeService(config, config_path=config_path)
    except ConfigFileError as exc:  # a certificate file changed between the check and its use
        return report_config_problems(config_path, exc)
    return await serve_edge(service)


if __name__ == "__main__":
    main()
