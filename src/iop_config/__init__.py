"""iop_config: YAML config files into frozen attrs classes, every error with file:line.

Both daemons load their config through :func:`load_config`::

    cfg = load_config("edge.yaml", EdgeConfig)   # raises ConfigFileError

Each error reads ``FILE:LINE: FIELD.PATH: message``, e.g.
``edge.yaml:14: nodes[0].providers[1].capacity: must be >= 1``.

Both daemons' entry points share the rest of their start too (:mod:`._daemon`): the command line
(:func:`daemon_arguments`), a config that does not load printed one problem a line and
:data:`EXIT_CONFIG` (:func:`report_config_problems`), the signals (:func:`shutdown_signals`,
:func:`reload_signals`) and the collector policy (:func:`tune_collector`).
"""

from ._converter import make_converter
from ._daemon import (
    EXIT_CONFIG,
    config_problems,
    daemon_arguments,
    reload_signals,
    report_config_problems,
    shutdown_signals,
    tune_collector,
)
from ._loader import load_config, load_config_text
from ._positions import ConfigFileError, format_path, parse_path
from ._tls import TlsFileError, client_ssl_context, server_ssl_context, tls_problems

__all__ = [
    "EXIT_CONFIG",
    "ConfigFileError",
    "TlsFileError",
    "client_ssl_context",
    "config_problems",
    "daemon_arguments",
    "format_path",
    "load_config",
    "load_config_text",
    "make_converter",
    "parse_path",
    "reload_signals",
    "report_config_problems",
    "server_ssl_context",
    "shutdown_signals",
    "tls_problems",
    "tune_collector",
]
