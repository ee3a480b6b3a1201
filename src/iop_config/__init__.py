"""iop_config: YAML config files into frozen attrs classes, every error with file:line.

Both daemons load their config through :func:`load_config`::

    cfg = load_config("edge.yaml", EdgeConfig)   # raises ConfigFileError

Each error reads ``FILE:LINE: FIELD.PATH: message``, e.g.
``edge.yaml:14: nodes[0].providers[1].capacity: must be >= 1``.
"""

from ._command import daemon_arguments
from ._converter import make_converter
from ._loader import load_config, load_config_text
from ._positions import ConfigFileError, format_path, parse_path
from ._tls import TlsFileError, client_ssl_context, server_ssl_context, tls_problems

__all__ = [
    "ConfigFileError",
    "TlsFileError",
    "client_ssl_context",
    "daemon_arguments",
    "format_path",
    "load_config",
    "load_config_text",
    "make_converter",
    "parse_path",
    "server_ssl_context",
    "tls_problems",
]
