"""Certificates made per test run (trustme): a CA, a server certificate for loopback,
client certificates whose common name is a role, and expired ones.

::

    certs = Certificates(tmp_path)            # files written under tmp_path
    certs.ca                                  # the CA's PEM file (tls_trust_certs_file)
    certs.server                              # cert + key PEM for 127.0.0.1 / localhost
    certs.client("app")                       # cert + key PEM whose CN is "app"
    certs.expired_server                      # a server certificate that expired

Needs ``trustme`` (a test dependency of the monorepo, not of any package).
"""

from __future__ import annotations

import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

__all__ = ["Certificates"]


class Certificates:
    """A CA and certificates it signed, as PEM files in ``directory``."""

    def __init__(self, directory: str | Path) -> None:
        import trustme

        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._ca: Any = trustme.CA(organization_name="PigeonMQ test CA")
        self.ca = self._write("ca.pem", self._ca.cert_pem)

    def _write(self, name: str, blob: Any) -> str:
        path = self.directory / name
        blob.write_to_path(str(path))
        return str(path)

    def issue(self, name: str, *identities: str, **kwargs: Any) -> str:
        """A certificate and its key in one PEM file ``<name>.pem``."""
        cert = self._ca.issue_cert(*identities, **kwargs)
        return self._write(f"{name}.pem", cert.private_key_and_cert_chain_pem)

    @cached_property
    def server(self) -> str:
        """A server certificate (with its key) for ``127.0.0.1`` and ``localhost``."""
        return self.issue("server", "127.0.0.1", "localhost", common_name="pigeon-node")

    @cached_property
    def expired_server(self) -> str:
        """A loopback server certificate that expired a day ago."""
        now = datetime.datetime.now(datetime.UTC)
        return self.issue(
            "expired-server",
            "127.0.0.1",
            "localhost",
            not_before=now - datetime.timedelta(days=30),
            not_after=now - datetime.timedelta(days=1),
        )

    def client(self, role: str) -> str:
        """A client certificate (with its key) whose common name is ``role``."""
        return self.issue(f"client-{role}", f"{role}.clients.test", common_name=role)

    @cached_property
    def other_ca(self) -> str:
        """The PEM file of a CA that signed none of these certificates."""
        import trustme

        return self._write("other-ca.pem", trustme.CA().cert_pem)
