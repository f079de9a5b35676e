"""Certificates, keys and tokens made per test run, and TOML configs that use them.

:class:`SecurityFiles` writes one CA, a server certificate for ``127.0.0.1`` and
``localhost`` (signed by that CA) and an HS256 secret key under a directory, mints tokens
by role, issues more certificates on demand (client certificates by role, an expired
one, any other), and gives the security keys of a node's ``[broker]`` / ``[bookie]``
table (:meth:`SecurityFiles.node_table`): TLS on the node's port, token authentication,
the node's own role as a superuser and its credentials for the links it dials.
:func:`write_toml` writes such tables to a file for ``--config``::

    sec = SecurityFiles.create(tmp_path / "sec")
    write_toml(tmp_path / "node.toml", {"broker": sec.node_table(), "bookie": sec.node_table()})
    sec.ca_file, sec.certificate_file, sec.key_file   # trust, the server's cert and key
    sec.client_certificate("app")                     # (cert, key) whose CN is "app"
    sec.expired_certificate()                         # (cert, key) that expired
    sec.issue("renewed", "127.0.0.1")                 # (cert, key) of any other
    sec.other_ca_file                                 # a CA that signed none of them
    sec.token("app", expiry_s=60)                     # a token signed with secret_key

Needs ``trustme`` (a test dependency).
"""

from __future__ import annotations

import datetime
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

if TYPE_CHECKING:
    import trustme

__all__ = ["NODE_ROLE", "SecurityFiles", "merge_tables", "toml_text", "write_toml"]

#: the role test nodes (brokers, bookies) authenticate as where they dial
NODE_ROLE = "pigeon-node"


@dataclass(frozen=True)
class SecurityFiles:
    """Files of one test run's PKI and token key (see the module doc)."""

    root: Path
    #: the CA every certificate is signed by (what clients trust)
    ca_file: Path
    #: the nodes' certificate (for 127.0.0.1 and localhost) and its private key
    certificate_file: Path
    key_file: Path
    #: the HS256 secret key tokens are signed with (raw bytes, mode 0600)
    secret_key_file: Path

    @classmethod
    def create(cls, root: Path, *, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> Self:
        import trustme

        from pigeon.core.tokens import create_secret_key

        root.mkdir(parents=True, exist_ok=True)
        ca = trustme.CA()
        files = cls(
            root=root,
            ca_file=root / "ca.pem",
            certificate_file=root / "node-cert.pem",
            key_file=root / "node-key.pem",
            secret_key_file=root / "secret.key",
        )
        ca.cert_pem.write_to_path(str(files.ca_file))
        ca.private_key_pem.write_to_path(str(files.ca_key_file))
        files.ca_key_file.chmod(0o600)
        files._write_certificate(ca.issue_cert(*hosts), "node")
        _write_private(files.secret_key_file, create_secret_key())
        return files

    @property
    def ca_key_file(self) -> Path:
        """The CA's private key (test certificates only; mode 0600)."""
        return self.root / "ca-key.pem"

    @cached_property
    def ca(self) -> trustme.CA:
        """The run's CA (signs what :meth:`issue` writes)."""
        import trustme

        return trustme.CA.from_pem(self.ca_file.read_bytes(), self.ca_key_file.read_bytes())

    @property
    def other_ca_file(self) -> Path:
        """The certificate of a CA that signed none of the run's certificates."""
        import trustme

        path = self.root / "other-ca.pem"
        if not path.exists():
            trustme.CA().cert_pem.write_to_path(str(path))
        return path

    def issue(self, name: str, *hosts: str, **kwargs: Any) -> tuple[Path, Path]:
        """(certificate chain, private key) files ``<name>-cert.pem`` / ``<name>-key.pem``
        of a new certificate the run's CA signs for ``hosts`` (``kwargs``: trustme's
        ``issue_cert``: ``common_name``, ``not_before``, ``not_after``...); written
        again at each call."""
        return self._write_certificate(self.ca.issue_cert(*hosts, **kwargs), name)

    def _write_certificate(self, cert: trustme.LeafCert, name: str) -> tuple[Path, Path]:
        cert_path, key_path = self.root / f"{name}-cert.pem", self.root / f"{name}-key.pem"
        cert.cert_chain_pems[0].write_to_path(str(cert_path))
        for pem in cert.cert_chain_pems[1:]:
            pem.write_to_path(str(cert_path), append=True)
        cert.private_key_pem.write_to_path(str(key_path))
        key_path.chmod(0o600)
        return cert_path, key_path

    def client_certificate(self, role: str) -> tuple[Path, Path]:
        """(certificate, private key) files of a client certificate signed by the run's
        CA whose common name is ``role`` (the ``tls`` provider's role)."""
        cert_path, key_path = (
            self.root / f"client-{role}-cert.pem",
            self.root / f"client-{role}-key.pem",
        )
        if cert_path.exists():
            return cert_path, key_path
        return self.issue(f"client-{role}", f"{role}.client.invalid", common_name=role)

    def expired_certificate(self) -> tuple[Path, Path]:
        """(certificate, private key) files of a certificate for ``127.0.0.1`` and
        ``localhost`` signed by the run's CA that expired a day ago."""
        cert_path, key_path = self.root / "expired-cert.pem", self.root / "expired-key.pem"
        if cert_path.exists():
            return cert_path, key_path
        now = datetime.datetime.now(datetime.UTC)
        return self.issue(
            "expired",
            "127.0.0.1",
            "localhost",
            not_before=now - datetime.timedelta(days=30),
            not_after=now - datetime.timedelta(days=1),
        )

    @property
    def secret_key(self) -> bytes:
        """The HS256 secret key tokens are signed with."""
        return self.secret_key_file.read_bytes()

    @property
    def secret_key_url(self) -> str:
        return f"file://{self.secret_key_file}"

    def token(self, role: str, *, expiry_s: int | None = None, key: bytes | None = None) -> str:
        """A token for ``role`` signed with the run's secret key (or ``key``)."""
        from pigeon.core.tokens import create_token

        return create_token(role, key or self.secret_key, expiry_s=expiry_s)

    def token_file(self, role: str) -> Path:
        """A file (mode 0600) holding a token for ``role`` (``file:///...`` for configs)."""
        path = self.root / f"token-{role}.jwt"
        if not path.exists():
            _write_private(path, self.token(role).encode())
        return path

    def client_tls_context(self, role: str | None = None) -> ssl.SSLContext:
        """What a client dialling the nodes over TLS uses: trusts the run's CA and, with
        ``role``, presents a client certificate whose common name is ``role``."""
        from pigeon.core.tls import client_context

        cert, key = self.client_certificate(role) if role is not None else ("", "")
        return client_context(
            trust_certs_file=str(self.ca_file), certificate_file=str(cert), key_file=str(key)
        )

    def node_table(
        self,
        *,
        role: str = NODE_ROLE,
        superuser_roles: tuple[str, ...] = (),
        tls: bool = True,
        authentication: bool = True,
    ) -> dict[str, Any]:
        """The security keys of a node's ``[broker]`` or ``[bookie]`` table: TLS with the
        run's certificate, token authentication with its secret key, ``role`` (the
        nodes' own) and ``superuser_roles`` as superusers, and the links the node dials
        over TLS with a token for ``role``."""
        table: dict[str, Any] = {}
        if tls:
            table |= {
                "tls_certificate_file": str(self.certificate_file),
                "tls_key_file": str(self.key_file),
                "tls_trust_certs_file": str(self.ca_file),
                "broker_client_tls_enabled": True,
            }
        if authentication:
            table |= {
                "authentication_enabled": True,
                "authentication_providers": ["token"],
                "token_secret_key": self.secret_key_url,
                "superuser_roles": [role, *superuser_roles],
                "broker_client_authentication_plugin": "token",
                "broker_client_authentication_parameters": f"file://{self.token_file(role)}",
            }
        return table


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def merge_tables(
    *configs: Mapping[str, Mapping[str, Any]] | None,
) -> dict[str, dict[str, Any]]:
    """TOML tables merged key by key (later configs win), ``None`` skipped."""
    out: dict[str, dict[str, Any]] = {}
    for config in configs:
        for section, table in (config or {}).items():
            out.setdefault(section, {}).update(table)
    return out


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str | Path):
        text = str(value).replace("\\", "\\\\").replace('"', '\\"')
        return f'"{text}"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def toml_text(tables: Mapping[str, Mapping[str, Any]]) -> str:
    """TOML of ``{section: {key: value}}`` (strings, numbers, booleans, lists)."""
    lines: list[str] = []
    for section, table in tables.items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in table.items())
        lines.append("")
    return "\n".join(lines)


def write_toml(path: Path, tables: Mapping[str, Mapping[str, Any]]) -> Path:
    """Write ``{section: {key: value}}`` as a TOML file; returns ``path``."""
    path.write_text(toml_text(tables))
    return path
