"""A daemon's command line: ``--config FILE [--log-level LEVEL]``, and its logging set up.

The Edge and the Node take the same two options and log the same way; :func:`daemon_arguments`
is both commands' first step.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


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
