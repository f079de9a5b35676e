"""The Cap'n Proto schemas shipped with pigeon-core, loaded once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import capnp  # type: ignore[import-untyped]

__all__ = ["PROTOCOL_VERSION", "SCHEMA_DIR", "BookieFrame", "BrokerFrame", "protocol"]

SCHEMA_DIR = Path(__file__).parent / "schema"

#: Version exchanged in the ``connect`` handshake. Bump on incompatible changes.
PROTOCOL_VERSION = 1

protocol: Any = capnp.load(str(SCHEMA_DIR / "protocol.capnp"))
BrokerFrame: Any = protocol.BrokerFrame
BookieFrame: Any = protocol.BookieFrame
