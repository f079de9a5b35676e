"""What a running PigeonMQ node shares: opening its metadata store by URL, running until
SIGINT/SIGTERM, the server interpreter settings, and a wall clock that moves with trio's
(so that ``MockClock`` drives publish times, delays and TTLs in tests).
"""

from __future__ import annotations

from pigeon.core._clock import WallClock
from pigeon.core._runtime import open_metadata_store, run_until_signal, tune_server_interpreter

__all__ = ["WallClock", "open_metadata_store", "run_until_signal", "tune_server_interpreter"]
