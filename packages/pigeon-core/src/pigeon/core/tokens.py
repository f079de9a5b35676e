"""Token authentication's keys and tokens (JWT, via PyJWT), as Pulsar's ``tokens`` tool.

A token is a JWT whose subject (``sub``) is the client's **role**; ``exp``, when present,
is enforced.  It is signed either with a secret key (HS256) or with the private key of a
key pair (RS256, ES256) and validated with the secret or the public key.  Keys are given
as Pulsar gives them: ``file:///path/to/key`` or ``data:;base64,<key>`` (a bare path is
read as a file too), so that no secret has to appear on a command line.

``pigeon tokens`` creates keys and tokens and validates tokens with these functions, and
so does the ``token`` authentication provider of brokers and bookies
(:mod:`pigeon.core.auth`).  Needs PyJWT with its crypto extra (``pyjwt[crypto]``), a
dependency of pigeon-broker and pigeon-bookie, not of the client.
"""

from __future__ import annotations

import base64
import binascii
import re
import secrets
import time
from pathlib import Path
from typing import Final

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from pigeon.core.errors import AuthenticationError, ConfigError

__all__ = [
    "KEY_PAIR_ALGORITHMS",
    "create_key_pair",
    "create_secret_key",
    "create_token",
    "check_key",
    "load_key",
    "parse_duration",
    "validate_token",
]

#: algorithms of key pairs (the secret-key algorithm is HS256)
KEY_PAIR_ALGORITHMS: Final = ("RS256", "ES256")
SECRET_KEY_ALGORITHM: Final = "HS256"
#: bytes of a secret key (HS256 wants at least 32)
SECRET_KEY_BYTES: Final = 32
_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def create_secret_key() -> bytes:
    """A new random secret key for HS256 tokens."""
    return secrets.token_bytes(SECRET_KEY_BYTES)


def create_key_pair(algorithm: str = "RS256") -> tuple[bytes, bytes]:
    """(private key, public key), PEM-encoded, for RS256 or ES256 tokens."""
    if algorithm == "RS256":
        private: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey = rsa.generate_private_key(
            public_exponent=65537, key_size=2048
        )
    elif algorithm == "ES256":
        private = ec.generate_private_key(ec.SECP256R1())
    else:
        raise ConfigError(
            f"key pair algorithm {algorithm!r} is not one of {', '.join(KEY_PAIR_ALGORITHMS)}"
        )
    private_pem = private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    public_pem = private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return private_pem, public_pem


def load_key(spec: str) -> bytes:
    """A key from ``file:///path``, ``data:;base64,...`` or a plain path.

    :raises ConfigError: the file cannot be read or the data is not base64.
    """
    if spec.startswith("data:"):
        _, _, payload = spec.partition(",")
        try:
            return base64.b64decode(payload, validate=True)
        except binascii.Error:
            raise ConfigError("the key's data: URL does not hold base64") from None
    path = spec.removeprefix("file://")
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        # A plain value may be the key itself pasted in place of a path: not echoed.
        shown = repr(path) if spec.startswith("file://") else "(a plain value, not shown)"
        raise ConfigError(
            f"cannot read the key file {shown}: {exc.strerror} (give the key as"
            " file:///path or data:;base64,...)"
        ) from None


def parse_duration(text: str) -> int:
    """Seconds of ``30s``, ``15m``, ``12h``, ``1d``, ``2w``, ``1y`` (or plain seconds).

    :raises ConfigError: anything else.
    """
    match = re.fullmatch(r"\s*(\d+)\s*([smhdwy]?)\s*", text)
    if match is None or int(match.group(1)) <= 0:
        raise ConfigError(f"expiry {text!r} is not a positive duration like 30m, 12h, 1d, 2w or 1y")
    return int(match.group(1)) * _UNITS[match.group(2) or "s"]


def _algorithm_of(key: bytes, private: bool) -> str:
    """HS256 for a secret, RS256 or ES256 for a PEM key (from the key itself)."""
    if not key.lstrip().startswith(b"-----BEGIN"):
        return SECRET_KEY_ALGORITHM
    try:
        loaded = (
            serialization.load_pem_private_key(key, password=None)
            if private
            else serialization.load_pem_public_key(key)
        )
    except (ValueError, TypeError) as exc:
        kind = "private" if private else "public"
        raise ConfigError(f"the {kind} key is not a PEM key PyJWT can use: {exc}") from None
    if isinstance(loaded, rsa.RSAPrivateKey | rsa.RSAPublicKey):
        return "RS256"
    if isinstance(loaded, ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey):
        return "ES256"
    raise ConfigError(f"keys of type {type(loaded).__name__} are not supported")


def create_token(subject: str, key: bytes, *, expiry_s: int | None = None) -> str:
    """A token for role ``subject``, signed with a secret key or a private key (PEM);
    it expires ``expiry_s`` seconds from now (never, without it)."""
    if not subject:
        raise ConfigError("a token needs a subject (the role it grants)")
    claims: dict[str, object] = {"sub": subject}
    if expiry_s is not None:
        claims["exp"] = int(time.time()) + expiry_s
    return jwt.encode(claims, key, algorithm=_algorithm_of(key, private=True))


def validate_token(token: str, key: bytes) -> str:
    """The role (``sub``) of a valid token, checked with a secret key or a public key
    (PEM); ``exp`` is enforced.

    :raises AuthenticationError: malformed, wrongly signed, expired, or without subject
        (the message says which, never the token).
    """
    algorithm = _algorithm_of(key, private=False)
    try:
        claims = jwt.decode(
            token.strip(),
            key,
            algorithms=[algorithm],
            options={"require": ["sub"], "verify_exp": True},
        )
    except jwt.ExpiredSignatureError:
        raise AuthenticationError("the token has expired") from None
    except jwt.InvalidSignatureError:
        raise AuthenticationError("the token's signature does not match the key") from None
    except jwt.MissingRequiredClaimError:
        raise AuthenticationError("the token has no subject (role)") from None
    except jwt.InvalidAlgorithmError:
        raise AuthenticationError(f"the token is not signed with {algorithm}") from None
    except jwt.PyJWTError as exc:
        raise AuthenticationError(f"the token is not valid: {exc}") from None
    subject = claims.get("sub")
    if not isinstance(subject, str) or not subject:
        raise AuthenticationError("the token's subject (role) is not a non-empty string")
    return subject


def check_key(key: bytes) -> str:
    """The algorithm tokens checked with ``key`` must use (a secret: HS256; a PEM
    public key: RS256 or ES256).

    :raises ConfigError: a PEM key PyJWT cannot use.
    """
    return _algorithm_of(key, private=False)
