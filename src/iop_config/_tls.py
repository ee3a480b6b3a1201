"""TLS files named in a config: SSL contexts built from them, and their problems as config errors.

Both daemons name certificate and key files in their config. The same
function builds the :class:`ssl.SSLContext` at start and on reload, and checks
the files while the config is validated, so a missing file or a key that does
not match its certificate is reported like every other config error:
``edge.yaml:9: node_tls.key_file: does not match the certificate in cert_file``.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Iterator
from typing import final

__all__ = ["TlsFileError", "client_ssl_context", "server_ssl_context", "tls_problems"]


@final
class TlsFileError(Exception):
    """A TLS file cannot be used; ``field`` names the config key (``cert_file``, ...)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


def _no_password() -> bytes:
    return b""  # an encrypted key is refused instead of prompting on the terminal


def _readable(field: str, path: str) -> None:
    try:
        with open(path, "rb") as file:
            file.read(1)
    except OSError as exc:
        raise TlsFileError(field, f"cannot read {path!r}: {exc.strerror or exc}") from None


def _load_chain(context: ssl.SSLContext, cert_file: str, key_file: str) -> None:
    """Load a certificate and its key into ``context``, naming the field at fault."""
    _readable("cert_file", cert_file)
    _readable("key_file", key_file)
    try:
        ssl.create_default_context(cafile=cert_file)
    except ssl.SSLError:
        raise TlsFileError("cert_file", f"{cert_file!r} holds no PEM certificate") from None
    try:
        context.load_cert_chain(cert_file, key_file, password=_no_password)
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc) or "key values mismatch" in str(exc):
            raise TlsFileError("key_file", f"{key_file!r} does not match the certificate in cert_file") from None
        raise TlsFileError("key_file", f"{key_file!r} holds no unencrypted PEM private key") from None


def _load_ca(context: ssl.SSLContext, field: str, ca_file: str) -> None:
    _readable(field, ca_file)
    try:
        context.load_verify_locations(cafile=ca_file)
    except ssl.SSLError:
        raise TlsFileError(field, f"{ca_file!r} holds no PEM certificate") from None


def server_ssl_context(cert_file: str, key_file: str, client_ca_file: str | None = None) -> ssl.SSLContext:
    """A server context (TLS 1.2 and up) serving ``cert_file``.

    With ``client_ca_file`` every client must present a certificate issued by
    one of its CAs (mutual TLS); the caller checks what the certificate names.

    Raises:
        TlsFileError: a file is missing or unreadable, not PEM, or the key does
            not match the certificate.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # trusts no CA but client_ca_file
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(context, cert_file, key_file)
    if client_ca_file is not None:
        _load_ca(context, "client_ca_file", client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_ssl_context(
    ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None
) -> ssl.SSLContext:
    """A client context that verifies the server (the system CAs, or ``ca_file`` instead).

    ``cert_file`` and ``key_file`` (both or neither) are presented to a server
    that asks for a client certificate.

    Raises:
        TlsFileError: as :func:`server_ssl_context`.
    """
    if ca_file is None:
        context = ssl.create_default_context()
    else:
        _readable("ca_file", ca_file)
        try:
            context = ssl.create_default_context(cafile=ca_file)  # this CA only, not the system's
        except ssl.SSLError:
            raise TlsFileError("ca_file", f"{ca_file!r} holds no PEM certificate") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert_file is not None and key_file is not None:
        _load_chain(context, cert_file, key_file)
    return context


def tls_problems(path: str, build: Callable[[], ssl.SSLContext]) -> Iterator[tuple[str, str]]:
    """Run ``build`` (a context factory) and report its :class:`TlsFileError` at ``path.field``."""
    try:
        build()
    except TlsFileError as exc:
        yield f"{path}.{exc.field}", exc.message
