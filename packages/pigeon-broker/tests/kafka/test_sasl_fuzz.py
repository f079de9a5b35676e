"""Fuzzing the Kafka SASL exchange: whatever bytes a client sends as its mechanism or
its credentials, the session answers with a typed refusal (``SaslFailure``) or a token
to check, never another exception, and a garbage token is an authentication error."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pigeon.broker._kafka_sasl import SaslFailure, SaslSession
from pigeon.core.auth import AuthData, Authenticator, TokenAuthenticationProvider
from pigeon.core.errors import AuthenticationError
from pigeon.core.testing.fuzz import fuzz_settings

FUZZ = fuzz_settings("PIGEON_FUZZ_EXAMPLES", 300)
AUTH = Authenticator([TokenAuthenticationProvider(b"k" * 32)])

#: credentials shaped like the two mechanisms' messages, and anything at all
CREDENTIALS = st.one_of(
    st.binary(max_size=2048),
    st.builds(lambda u, p: b"\0" + u + b"\0" + p, st.binary(max_size=64), st.binary(max_size=512)),
    st.builds(lambda t: b"n,,\x01auth=Bearer " + t + b"\x01\x01", st.binary(max_size=512)),
)


@FUZZ
@given(
    mechanism=st.one_of(st.sampled_from(["PLAIN", "OAUTHBEARER"]), st.text(max_size=30)),
    version=st.integers(0, 1),
    credentials=CREDENTIALS,
)
def test_any_sasl_exchange_ends_in_a_typed_answer(
    mechanism: str, version: int, credentials: bytes
) -> None:
    session = SaslSession(["PLAIN", "OAUTHBEARER"])
    try:
        session.handshake(mechanism, version)
        token = session.token(credentials, raw=version == 0)
    except SaslFailure:
        return  # refused in Kafka's words (an error code and a message)
    with pytest.raises(AuthenticationError):
        AUTH.authenticate(AuthData("token", token.encode("utf-8", "surrogateescape")))
