"""TLS for every PigeonMQ link (stdlib :mod:`ssl` through :class:`trio.SSLStream`).

* :class:`ServerTls` holds a listener's certificate, key and trusted CAs in one
  :class:`ssl.SSLContext`; :meth:`ServerTls.reload` (on SIGHUP: :func:`reload_on_sighup`)
  loads changed files into that same context, so new handshakes use the new certificate
  while open connections keep running undisturbed.  With ``require_client_cert`` the peer
  must present a certificate signed by a trusted CA (mutual TLS); its common name can then
  be the peer's role (the ``tls`` authentication provider).
* :func:`client_context` builds a dialling side's context: trusted CAs (the system's when
  none are given), hostname verification on unless turned off, an optional client
  certificate.
* :func:`accept_tls` and :func:`connect_tls` run the handshake under a deadline and turn
  every failure into one line (:func:`describe_tls_error`): a wrong CA, an expired or
  not-yet-valid certificate, a host name the certificate does not name, a plaintext peer.
"""

from __future__ import annotations

import logging
import os
import signal
import ssl
import threading
from typing import Any

import trio

from pigeon.core.errors import ConfigError, ConnectionClosed, TlsError

__all__ = [
    "ServerTls",
    "accept_tls",
    "client_context",
    "connect_tls",
    "describe_tls_error",
    "reload_on_sighup",
    "server_context",
]

log = logging.getLogger(__name__)

#: how long a TLS handshake may take before the connection is dropped
HANDSHAKE_TIMEOUT_S = 10.0
#: bytes a TLS stream reads from its socket at a time.  ``trio.SSLStream`` asks its
#: transport for 64 KiB; at 100 MB/s and more, that many trips through it took about a
#: third of a link's CPU (docs/benchmarks.md, "TLS and authentication").
TRANSPORT_RECEIVE_SIZE = 256 * 1024


class _LargeReads(trio.abc.Stream):
    """The stream under a ``trio.SSLStream``, read :data:`TRANSPORT_RECEIVE_SIZE`
    bytes at a time when the TLS layer does not say how much."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.stream.receive_some(max_bytes or TRANSPORT_RECEIVE_SIZE)

    async def aclose(self) -> None:
        await self.stream.aclose()


def _load_chain(ctx: ssl.SSLContext, certificate_file: str, key_file: str, what: str) -> None:
    try:
        ctx.load_cert_chain(certificate_file, key_file or None)
    except FileNotFoundError as exc:
        missing = exc.filename or _first_missing(certificate_file, key_file)
        raise ConfigError(f"{what}: cannot read {missing!r}: no such file") from None
    except PermissionError as exc:
        name = exc.filename or f"{certificate_file} or {key_file}"
        raise ConfigError(f"{what}: cannot read {name!r}: permission denied") from None
    except ssl.SSLError as exc:
        raise ConfigError(
            f"{what}: {certificate_file!r} and {key_file!r} are not a PEM certificate and"
            f" its private key ({exc.reason or exc})"
        ) from None


def _first_missing(*paths: str) -> str:
    """The first of ``paths`` that does not exist (ssl does not say which it missed)."""
    return next((p for p in paths if p and not os.path.exists(p)), paths[0])


def _load_trust(ctx: ssl.SSLContext, trust_certs_file: str, what: str) -> None:
    try:
        ctx.load_verify_locations(cafile=trust_certs_file)
    except FileNotFoundError:
        raise ConfigError(f"{what}: cannot read {trust_certs_file!r}: no such file") from None
    except PermissionError:
        raise ConfigError(f"{what}: cannot read {trust_certs_file!r}: permission denied") from None
    except ssl.SSLError as exc:
        raise ConfigError(
            f"{what}: {trust_certs_file!r} holds no PEM CA certificate ({exc.reason or exc})"
        ) from None


def server_context(
    *,
    certificate_file: str,
    key_file: str,
    trust_certs_file: str = "",
    require_client_cert: bool = False,
    what: str = "TLS",
) -> ssl.SSLContext:
    """A server context (TLS 1.2 or later) with this certificate chain and key.

    ``trust_certs_file``: CAs whose client certificates are accepted; with
    ``require_client_cert`` a client without one that verifies is refused.

    :raises ConfigError: a file that is missing or not PEM (one line naming it).
    """
    if not certificate_file or not key_file:
        raise ConfigError(f"{what}: 'tls_certificate_file' and 'tls_key_file' are both needed")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(ctx, certificate_file, key_file, what)
    if trust_certs_file:
        _load_trust(ctx, trust_certs_file, what)
        ctx.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_OPTIONAL
    elif require_client_cert:
        raise ConfigError(
            f"{what}: 'tls_require_trusted_client_cert' needs 'tls_trust_certs_file' (the CAs"
            " client certificates must be signed by)"
        )
    return ctx


def client_context(
    *,
    trust_certs_file: str = "",
    certificate_file: str = "",
    key_file: str = "",
    verify_hostname: bool = True,
    allow_insecure: bool = False,
    what: str = "TLS",
) -> ssl.SSLContext:
    """A dialling side's context: the server's certificate must be signed by a CA of
    ``trust_certs_file`` (the system's CAs when empty) and, unless ``verify_hostname`` is
    off, name the host dialled.  ``allow_insecure`` accepts any certificate (tests and
    debugging only).  ``certificate_file``/``key_file``: a client certificate (mTLS)."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if trust_certs_file:
        _load_trust(ctx, trust_certs_file, what)
    if certificate_file:
        _load_chain(ctx, certificate_file, key_file, what)
    if allow_insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    elif not verify_hostname:
        ctx.check_hostname = False
    return ctx


class ServerTls:
    """A listener's TLS: one context its connections share, reloadable in place."""

    def __init__(
        self,
        *,
        certificate_file: str,
        key_file: str,
        trust_certs_file: str = "",
        require_client_cert: bool = False,
        what: str = "TLS",
    ) -> None:
        self.certificate_file = certificate_file
        self.key_file = key_file
        self.trust_certs_file = trust_certs_file
        self.require_client_cert = require_client_cert
        self.what = what
        #: the context of listeners that enforce ``require_client_cert`` in the TLS
        #: handshake itself (HTTPS, Kafka)
        self.context = server_context(
            certificate_file=certificate_file,
            key_file=key_file,
            trust_certs_file=trust_certs_file,
            require_client_cert=require_client_cert,
            what=what,
        )
        #: the context of PigeonMQ's own ports: a client certificate is asked for but
        #: its absence is refused by the ``connect`` handshake (:func:`accept_tls`'s
        #: caller), in words the client can show; TLS 1.3 would only close the stream
        self.protocol_context = self.context
        if require_client_cert:
            self.protocol_context = server_context(
                certificate_file=certificate_file,
                key_file=key_file,
                trust_certs_file=trust_certs_file,
                what=what,
            )
        self.reloads = 0

    def reload(self) -> bool:
        """Read the certificate, key and CAs again into the shared context; True when
        they loaded.  A file that does not load (half-written, wrong key) leaves the
        current ones in place and logs one ERROR line: a bad reload never takes a
        listener down."""
        try:  # check the files on a scratch context first: all or nothing
            server_context(
                certificate_file=self.certificate_file,
                key_file=self.key_file,
                trust_certs_file=self.trust_certs_file,
                require_client_cert=self.require_client_cert,
                what=self.what,
            )
            for ctx in {id(c): c for c in (self.context, self.protocol_context)}.values():
                _load_chain(ctx, self.certificate_file, self.key_file, self.what)
                if self.trust_certs_file:
                    _load_trust(ctx, self.trust_certs_file, self.what)
        except ConfigError as exc:
            log.error(  # noqa: TRY400 - one line, no traceback
                "TLS reload failed, the current certificate stays: %s", exc.message
            )
            return False
        self.reloads += 1
        log.info("TLS certificate reloaded listener=%s file=%s", self.what, self.certificate_file)
        return True


#: the listeners' certificates every SIGHUP reloads (one process may run several nodes:
#: ``pigeon standalone``'s broker and bookie), and whether a receiver task is running
_on_sighup: list[ServerTls] = []
_receiving = False


async def reload_on_sighup(
    *tls: ServerTls, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Reload these listeners' certificates on every SIGHUP, until cancelled.

    Any number of these tasks may run in one process: trio delivers a signal to one
    receiver only, so the first task receives and every task's certificates are
    reloaded.  Outside the main thread (a node embedded in a test) signals cannot be
    received: then this only reports started and waits."""
    global _receiving
    _on_sighup.extend(tls)
    try:
        if _receiving or threading.current_thread() is not threading.main_thread():
            task_status.started()
            await trio.sleep_forever()
        _receiving = True
        try:
            with trio.open_signal_receiver(signal.SIGHUP) as signals:
                task_status.started()
                async for _ in signals:
                    for one in list(_on_sighup):
                        one.reload()
        finally:
            _receiving = False
    finally:
        for one in tls:
            _on_sighup.remove(one)


def describe_tls_error(exc: BaseException, *, server_side: bool = False) -> str:
    """One line for a failed handshake, without OpenSSL's file/line noise."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        reason = exc.verify_message or exc.reason or str(exc)
        if exc.verify_code == 10:
            return "the server's certificate has expired"
        if exc.verify_code == 9:
            return "the server's certificate is not yet valid"
        if exc.verify_code in (62, 64) or "hostname" in str(reason).lower():
            return f"the server's certificate does not name this host ({reason})"
        if exc.verify_code in (19, 20, 21):
            return (
                "the server's certificate is not signed by a trusted CA (check"
                f" tls_trust_certs_file: {reason})"
            )
        return f"certificate verify failed: {reason}"
    if isinstance(exc, ssl.SSLError):
        reason = (exc.reason or str(exc)).lower().replace("_", " ")
        if "unexpected eof" in reason or "eof occurred" in reason:
            if server_side:
                return (
                    "the client closed the connection during the TLS handshake (does it"
                    " trust this server's certificate?)"
                )
            return "the server closed the connection during the TLS handshake"
        if "alert protocol version" in reason:
            return "the server refused TLS: it is a plaintext port (use pigeon:// there)"
        if "wrong version number" in reason or "record layer failure" in reason:
            return "the peer does not speak TLS (a plaintext port?)"
        if "http request" in reason:
            return "the peer sent an HTTP request, not a TLS handshake"
        if (
            "certificate required" in reason
            or "peer did not return a certificate" in reason
            or "alert bad certificate" in reason
        ):
            return "a client certificate is required (tls_require_trusted_client_cert)"
        if "certificate unknown" in reason or "unknown ca" in reason:
            return "the peer did not accept our certificate"
        if "certificate expired" in reason:
            return "the peer's certificate (or ours) has expired"
        return f"TLS error: {reason}"
    if isinstance(exc, trio.BrokenResourceError) and exc.__cause__ is not None:
        return describe_tls_error(exc.__cause__, server_side=server_side)
    if isinstance(exc, trio.TooSlowError):
        return f"no TLS handshake within {HANDSHAKE_TIMEOUT_S:g}s"
    if isinstance(exc, trio.BrokenResourceError | trio.ClosedResourceError | OSError):
        return "the peer closed the connection during the TLS handshake"
    return f"TLS handshake failed: {exc}"


def _handshake_error(
    exc: BaseException, prefix: str, *, server_side: bool = False
) -> ConnectionClosed | TlsError:
    """:class:`TlsError` (not retriable) when the handshake itself refused (a
    certificate, a protocol); :class:`ConnectionClosed` when the peer went away or took
    too long (retriable)."""
    cause = exc.__cause__ if isinstance(exc, trio.BrokenResourceError) else exc
    message = prefix + describe_tls_error(exc, server_side=server_side)
    if isinstance(cause, ssl.SSLError) and not isinstance(cause, ssl.SSLEOFError):
        return TlsError(message)
    # the peer closed without a word (a node killed mid-handshake, a load balancer
    # between): retriable; a plaintext PigeonMQ port answers with an alert instead
    return ConnectionClosed(message)


async def accept_tls(
    stream: trio.abc.Stream,
    tls: ServerTls,
    *,
    handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
    strict: bool = False,
) -> trio.SSLStream[Any]:
    """Run the server side of the handshake of a PigeonMQ port; raises
    :class:`TlsError` or :class:`ConnectionClosed` with one line
    (:func:`describe_tls_error`) when it fails.  A missing client certificate is the
    caller's to refuse (``tls.require_client_cert``): see :attr:`ServerTls.protocol_context`;
    ``strict`` (another protocol's port, e.g. Kafka's) refuses it in the handshake itself."""
    context = tls.context if strict else tls.protocol_context
    ssl_stream = trio.SSLStream(_LargeReads(stream), context, server_side=True)
    try:
        with trio.fail_after(handshake_timeout):
            await ssl_stream.do_handshake()
    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, OSError) as exc:
        await trio.aclose_forcefully(stream)
        raise _handshake_error(exc, "", server_side=True) from None
    return ssl_stream


async def connect_tls(
    stream: trio.abc.Stream,
    context: ssl.SSLContext,
    server_hostname: str,
    *,
    handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
    address: str | None = None,
) -> trio.SSLStream[Any]:
    """Run the client side of the handshake against ``server_hostname``; raises
    :class:`TlsError` (a certificate or protocol refusal: retrying will not help) or
    :class:`ConnectionClosed` (the peer went away), with one line naming what failed
    and where (``address``, e.g. ``host:port``; default ``server_hostname``)."""
    ssl_stream = trio.SSLStream(_LargeReads(stream), context, server_hostname=server_hostname)
    try:
        with trio.fail_after(handshake_timeout):
            await ssl_stream.do_handshake()
    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, OSError) as exc:
        await trio.aclose_forcefully(stream)
        raise _handshake_error(exc, f"{address or server_hostname}: ") from None
    return ssl_stream
