"""Stored entries to Arrow record batches: the implementation is pigeon-client's
(:mod:`pigeon.client.arrow`, shared with the Arrow consumer API); the names the source
and its tests use are re-exported here."""

# The names are listed once, in ``pigeon.client.arrow.__all__``; this module re-exports
# exactly those.
from pigeon.client import arrow as _client_arrow
from pigeon.client.arrow import *  # noqa: F403

__all__ = list(_client_arrow.__all__)
