"""``iop-node --config node.yaml``: the Node daemon.

Exit codes: 0 after a graceful shutdown (SIGINT, SIGTERM; on Windows also
SIGBREAK, which Python raises for Ctrl+Break and console close); 2 when the
config cannot be loaded (any problem, including a missing token); 3 when the
Edge rejects the registration for good (bad token, protocol mismatch).

SIGHUP (where it exists) re-reads the config file. A file that does not load
is logged, every problem, and the node goes on with the config it has. A file
that loads replaces it: the node closes its connection like a shutdown (runs in
flight are cancelled, close 1001), then connects and registers again with the
new config, in the same process.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import AsyncIterator, Sequence
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
from iop_node._errors import RegistrationRejected
from iop_node._runtime import NodeRuntime
from iop_node.config import NodeConfig, load_node_config
from iop_node.edges.clients import EdgeClients

logger = logging.getLogger("iop_node")

EXIT_OK = 0
EXIT_REJECTED = 3
HARD_STOP_AFTER = 1.5
"""Seconds after a shutdown signal before everything is cancelled regardless."""
YOUNG_THRESHOLD: Final = 10_000
"""The node's young-generation threshold (:func:`iop_config.tune_collector`; CPython's default: 700).

The startup objects (the modules, the config) are frozen too: a reload builds a new config, but the
frozen one is still freed by reference counting.
"""


async def serve_node(config: NodeConfig, config_path: str | None = None) -> int:
    """Run the node until a shutdown signal or a final rejection; return the exit code.

    Checkpoints. On a shutdown signal every run is cancelled, a close 1001 is
    sent to the Edge, the upstream pools are closed, and 0 is returned. With
    ``config_path``, a reload signal re-reads that file: if it loads, the node
    stops the same way and starts again with it; if not, nothing changes.
    """
    with trio.open_signal_receiver(*shutdown_signals(), *reload_signals()) as signals:
        while True:
            outcome = await _serve_config(config, signals, config_path)
            if not isinstance(outcome, NodeConfig):
                return outcome
            config = outcome
            logger.info("reconnecting with the reloaded config")


async def _serve_config(config: NodeConfig, signals: AsyncIterator[int], config_path: str | None) -> int | NodeConfig:
    """Serve ``config`` until a shutdown (an exit code) or a reload that loaded (the new config)."""
    exit_code: int | NodeConfig = EXIT_OK
    async with NodeRuntime.from_config(config) as runtime:
        client = EdgeClients(config, runtime)
        async with trio.open_nursery() as nursery:

            async def stop_on_signal() -> None:
                nonlocal exit_code
                async for signum in signals:
                    if signum in reload_signals():
                        reloaded = await _reload(config_path)
                        if reloaded is None:
                            continue
                        exit_code = reloaded
                    else:
                        logger.info("%s received, shutting down", signal.Signals(signum).name)
                    client.shutdown()
                    # Hard stop if the graceful path somehow hangs.
                    await trio.sleep(HARD_STOP_AFTER)
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(stop_on_signal)
            try:
                await client.run()
            except RegistrationRejected as exc:
                logger.error("giving up: %s", exc)
                exit_code = EXIT_REJECTED
            nursery.cancel_scope.cancel()
    return exit_code


async def _reload(config_path: str | None) -> NodeConfig | None:
    """Load the config file again (in a worker thread); None, with every problem logged, if it does not load."""
    if config_path is None:
        logger.warning("SIGHUP ignored: no config file to re-read")
        return None
    logger.info("SIGHUP: re-reading %s", config_path)
    try:
        return await trio.to_thread.run_sync(load_node_config, config_path)
    except (ConfigFileError, OSError) as exc:
        logger.error("reload rejected, keeping the running config: %s", exc)
        return None


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point of ``iop-node``."""
    args = daemon_arguments(
        "iop-node", "IOP node daemon: serves local backends to the Edge.", "path to node.yaml", argv
    )
    # httpx logs one INFO line per upstream request: a cost per run worth nothing to an operator.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)
    try:
        config = load_node_config(args.config)
    except (ConfigFileError, OSError) as exc:
        sys.exit(report_config_problems(args.config, exc))
    tune_collector(YOUNG_THRESHOLD, freeze=True)
    sys.exit(trio.run(serve_node, config, args.config))


if __name__ == "__main__":
    main()
