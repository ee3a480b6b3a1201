"""``iop-edge --config edge.yaml``: the Edge daemon.

SIGHUP re-reads the config file and applies it (a rejected file keeps the old
config and logs every error). SIGINT/SIGTERM close every node connection and
stop. Exit codes: 0 after a shutdown signal, 2 when the config cannot be loaded.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence

import trio

from iop_config import ConfigFileError

from ._service import EdgeService
from .config import load_edge_config

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
                    logger.info("SIGHUP: reloading %s", service.config_path)
                    service.reload()
                    continue
                logger.info("%s received, shutting down", signal.Signals(signum).name)
                await service.registry.aclose_all()
                nursery.cancel_scope.cancel()
                break
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point of ``iop-edge``."""
    parser = argparse.ArgumentParser(
        prog="iop-edge", description="IOP Edge: OpenAI-compatible gateway with provider-wide admission."
    )
    parser.add_argument("--config", required=True, help="path to edge.yaml")
    parser.add_argument("--log-level", default="INFO", help="python logging level (default INFO)")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        config = load_edge_config(args.config)
    except ConfigFileError as exc:
        for error in exc.errors:
            print(error, file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None
    except OSError as exc:
        print(f"{args.config}: cannot read: {exc.strerror or exc}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None
    service = EdgeService(config, config_path=args.config)
    raise SystemExit(trio.run(serve_edge, service))


if __name__ == "__main__":
    main()
