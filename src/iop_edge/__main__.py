"""``iop-edge --config edge.yaml``: the Edge daemon.

SIGHUP re-reads the config file and applies it (a rejected file keeps the old
config and logs every error). SIGINT/SIGTERM close every node connection and
stop. Exit codes: 0 after a shutdown signal, 2 when the config cannot be loaded.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Sequence

import trio

from iop_config import ConfigFileError, daemon_arguments
from iop_edge._collector import tune as tune_collector
from iop_edge._service import EdgeService, load_config_off_loop

logger = logging.getLogger("iop_edge")

EXIT_OK = 0
EXIT_CONFIG = 2


async def serve_edge(service: EdgeService) -> int:
    """Serve until SIGINT/SIGTERM; reload on SIGHUP. Returns the exit code."""
    stop = [signal.SIGINT, signal.SIGTERM]
    reload = [signal.SIGHUP] if hasattr(signal, "SIGHUP") else []
    with trio.open_signal_receiver(*stop, *reload) as signals:
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
    tune_collector()
    raise SystemExit(trio.run(start_edge, args.config, instruments=instruments))


async def start_edge(config_path: str) -> int:
    """Load the config (in a worker thread) and serve it; the exit code."""
    try:
        config = await load_config_off_loop(config_path)
    except ConfigFileError as exc:
        for error in exc.errors:
            print(error, file=sys.stderr)
        return EXIT_CONFIG
    except OSError as exc:
        print(f"{config_path}: cannot read: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        service = EdgeService(config, config_path=config_path)
    except ConfigFileError as exc:  # a certificate file changed between the check and its use
        for error in exc.errors:
            print(error, file=sys.stderr)
        return EXIT_CONFIG
    return await serve_edge(service)


if __name__ == "__main__":
    main()
