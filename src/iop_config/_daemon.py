"""What both daemons' entry points do before they serve, in one place.

The Edge and the Node take the same command line (``--config FILE [--log-level LEVEL]``), log the
same way, report a config that does not load the same way (exit code :data:`EXIT_CONFIG`), stop
on the same signals and tune the garbage collector by one policy, each with its own figures.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Final, TextIO

from ._positions import ConfigFileError

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
EXIT_CONFIG: Final = 2
"""A daemon's exit code when its config file cannot be loaded (argparse's usage errors share it)."""


def daemon_arguments(prog: str, description: str, config_help: str, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``--config`` (required) and ``--log-level`` (default ``INFO``) from ``argv`` (None:
    ``sys.argv``), then log at that level to stderr in :data:`LOG_FORMAT`.

    Raises:
        SystemExit: the arguments are wrong (argparse's usage message, exit code 2), or ``--help``.
    """
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", required=True, help=config_help)
    parser.add_argument("--log-level", default="INFO", help="python logging level (default INFO)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    return args


def config_problems(path: str, exc: ConfigFileError | OSError) -> tuple[str, ...]:
    """The lines a daemon prints when the config file at ``path`` does not load.

    Every problem of a :class:`ConfigFileError` on its own line (``FILE:LINE: FIELD.PATH: problem``);
    a file that cannot be opened as ``FILE: cannot read: REASON``.
    """
    if isinstance(exc, ConfigFileError):
        return exc.errors
    return (f"{path}: cannot read: {exc.strerror or exc}",)


def report_config_problems(path: str, exc: ConfigFileError | OSError, stream: TextIO | None = None) -> int:
    """Print :func:`config_problems` on ``stream`` (None: stderr); return :data:`EXIT_CONFIG`."""
    for line in config_problems(path, exc):
        print(line, file=sys.stderr if stream is None else stream)
    return EXIT_CONFIG


def shutdown_signals() -> tuple[signal.Signals, ...]:
    """The signals that stop a daemon gracefully on this platform: SIGINT, SIGTERM, and on Windows
    SIGBREAK (which Python raises for Ctrl+Break and, through the C runtime, for console close)."""
    names = ("SIGINT", "SIGTERM", "SIGBREAK")
    return tuple(getattr(signal, name) for name in names if hasattr(signal, name))


def reload_signals() -> tuple[signal.Signals, ...]:
    """The signals that make a daemon re-read its config file: SIGHUP where it exists."""
    return (signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ()


def tune_collector(young_threshold: int, *, freeze: bool) -> None:
    """A daemon process's garbage-collector policy; set by the entry point, never by a library, so a
    daemon embedded in another program or a test keeps that program's policy.

    A daemon allocates short-lived objects per request and frees them by reference counting. With
    CPython's default young threshold a young collection comes every few requests under load, finds
    the objects of the requests in flight alive and promotes them, so the older generations grow and
    are scanned ever more often, and a full collection walks every long-lived object while holding
    the GIL (the loop stops for its whole length). ``young_threshold`` allocations (net of
    deallocations) between young collections let those objects die first; it also bounds the cyclic
    garbage kept between collections. The older generations keep their thresholds.

    ``freeze``: move every object alive now (the modules, the config) out of the collector's sight
    for good (still freed by reference counting), so no collection scans them again.
    """
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(young_threshold, middle, oldest)
    if freeze:
        gc.freeze()
