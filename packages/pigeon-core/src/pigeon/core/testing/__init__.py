"""pytest plugin for PigeonMQ and its plugin authors.

Load it with ``-p pigeon.core.testing`` (the monorepo does so in its root config).  It
offers the **contract suites** every backend runs against itself:

* :class:`MetadataStoreContract` — subclass it in a test module and provide a
  ``new_metadata_store`` fixture (a callable building a store that is not running yet);
  :func:`running_store`, :func:`store_factory`, :func:`next_event`, :func:`wait_event`
  and :func:`kill_ephemeral_owner` help a backend's own tests.
  :class:`MetadataServerContract` is the same for a backend on a real server of
  :mod:`pigeon.core.testing.servers`: name the server's fixture and the store class.
* :class:`CodecContract` — subclass it and provide a ``codec`` fixture.
* :class:`ReplicationPolicyContract` — subclass it and provide a ``make_policy`` fixture;
  it runs real in-process bookies (needs ``pigeon-bookie``).
* :class:`LedgerStorageContract` — subclass it and provide ``storage_name``,
  ``make_storage``, ``tear_tail`` and ``corrupt_entry`` fixtures: what every bookie
  storage backend (``pigeon_ledger_storages``) does, kill -9 included.

:func:`check_exports` checks a plugin's ``__all__`` as ``pigeon.core``'s own test does;
and the ``pigeon_standalone`` fixture: broker + bookie + embedded metadata in the test's
trio run over an in-memory network (pair it with ``autojump_clock`` for virtual time);
:func:`in_process_standalone` is the same as a context manager, with broker options;
:func:`receive_n` and :func:`drain` receive from a consumer of the trio client; the
``error_lines`` fixture collects the ERROR lines and tracebacks of the ``pigeon`` loggers
(:class:`pigeon.core.testing.fuzz.ErrorLines`).

Test helpers that start real servers as child processes live in
:mod:`pigeon.core.testing.servers`: ZooKeeper and etcd (``zookeeper_server``,
``etcd_server``), a ``pigeon standalone`` process (``Standalone``) and free loopback
ports.  Import them from there; they are plain classes and context managers, usable from
any fixture.  :class:`SecurityFiles` (also there) makes a run's CA, certificates, token
key and tokens, and the security keys of a node's configuration.
"""

from __future__ import annotations

from pigeon.core.testing._cluster import (
    InProcessStandalone,
    drain,
    in_process_standalone,
    pigeon_standalone,
    receive_n,
)
from pigeon.core.testing._codec_suite import CodecContract
from pigeon.core.testing._exports import check_exports
from pigeon.core.testing._metadata_helpers import (
    QUIET,
    WAIT,
    ExpireSession,
    MetadataStoreFactory,
    ServerRestart,
    kill_ephemeral_owner,
    next_event,
    run_until_ready_and_kill,
    running_store,
    store_factory,
    wait_event,
)
from pigeon.core.testing._metadata_suite import MetadataServerContract, MetadataStoreContract
from pigeon.core.testing._offloader_suite import OffloaderContract
from pigeon.core.testing._replication_suite import ReplicationPolicyContract
from pigeon.core.testing._security import SecurityFiles
from pigeon.core.testing._storage_suite import LedgerStorageContract
from pigeon.core.testing.fuzz import error_lines

__all__ = [
    "QUIET",
    "WAIT",
    "CodecContract",
    "ExpireSession",
    "InProcessStandalone",
    "LedgerStorageContract",
    "MetadataServerContract",
    "MetadataStoreContract",
    "MetadataStoreFactory",
    "OffloaderContract",
    "ReplicationPolicyContract",
    "SecurityFiles",
    "ServerRestart",
    "check_exports",
    "drain",
    "error_lines",
    "in_process_standalone",
    "kill_ephemeral_owner",
    "next_event",
    "pigeon_standalone",
    "receive_n",
    "run_until_ready_and_kill",
    "running_store",
    "store_factory",
    "wait_event",
]
