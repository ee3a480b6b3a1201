"""Certificates for the TLS tests, made at test time with ``trustme`` and written to files."""

from __future__ import annotations

import datetime
from pathlib import Path

import attrs
import trustme


@attrs.frozen
class CertFiles:
    """A leaf certificate (with its chain) and its key, as PEM files."""

    cert_file: Path
    key_file: Path


@attrs.define
class PrivateCA:
    """A private CA that writes its certificate and the leaves it issues into ``directory``."""

    directory: Path
    name: str
    ca: trustme.CA = attrs.field(factory=trustme.CA)

    @property
    def ca_file(self) -> Path:
        path = self.directory / f"{self.name}-ca.pem"
        if not path.exists():
            self.ca.cert_pem.write_to_path(str(path))
        return path

    def issue(self, label: str, *identities: str, expired: bool = False) -> CertFiles:
        """Issue a leaf for ``identities`` (subject alternative names) and write it as ``label``."""
        if expired:
            now = datetime.datetime.now(datetime.UTC)
            leaf = self.ca.issue_cert(
                *identities, not_before=now - datetime.timedelta(days=30), not_after=now - datetime.timedelta(days=1)
            )
        else:
            leaf = self.ca.issue_cert(*identities)
        files = CertFiles(self.directory / f"{label}-cert.pem", self.directory / f"{label}-key.pem")
        files.cert_file.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
        leaf.private_key_pem.write_to_path(str(files.key_file))
        return files
