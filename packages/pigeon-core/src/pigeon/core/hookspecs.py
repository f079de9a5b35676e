"""Hook specifications: every extension point of PigeonMQ.

Written like pytest's ``hookspec.py``: each hook has the ``pigeon_`` prefix and says
what it receives, what it returns and when it is called.  Hooks only *register* or
*build*; they never do I/O (pluggy cannot await).  Asynchronous work happens inside the
objects they register, in the node's own nurseries.

Built-in backends (the embedded metadata store, the quorum replication policy, the
``none`` and ``gzip`` codecs) are registered through these same hooks by
``pigeon.core._builtin``; external plugins are found through the ``pigeon``
entry-point group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import click

    from pigeon.core._plugins import Registry

hookspec = pluggy.HookspecMarker("pigeon")

# -- registration hooks: called once, when a PluginManager is built --------------------


@hookspec
def pigeon_metadata_stores(registry: Registry[Any]) -> None:
    """Register metadata store classes by URL scheme.

    :param registry: call ``registry.register(scheme, factory)`` where ``factory(url)``
        returns a :class:`pigeon.core.MetadataStore` for a URL such as
        ``zk://127.0.0.1:2181/chroot``.  A scheme may be registered once.

    Called for every plugin when the node's plugin manager is built; not firstresult.
    """


@hookspec
def pigeon_replication_policies(registry: Registry[Any]) -> None:
    """Register replication policies by name (``quorum``, ``leader-follower``, ...).

    :param registry: call ``registry.register(name, factory)``; ``factory(client, *,
        ensemble_size, write_quorum, ack_quorum, bookie_load)`` — ``client`` a
        :class:`pigeon.core.replication.BookieClient`, ``bookie_load(address)`` the
        bytes/s a bookie reported — returns a :class:`pigeon.core.ReplicationPolicy`,
        whose writers are :class:`pigeon.core.SegmentWriter` objects.

    Called for every plugin when the node's plugin manager is built; not firstresult.
    """


@hookspec
def pigeon_codecs(registry: Registry[Any]) -> None:
    """Register compression codecs.

    :param registry: call ``registry.register(name, codec)`` with a
        :class:`pigeon.core.Codec` (name, numeric wire id, ``compress``,
        ``decompress``).  Names and ids are unique.

    Called for every plugin when the node's plugin manager is built; not firstresult.
    """


@hookspec
def pigeon_authentication_providers(registry: Registry[Any]) -> None:
    """Register authentication providers by name (``token``, ``tls``, ...).

    :param registry: call ``registry.register(name, factory)``; ``factory(settings)`` —
        ``settings`` the node's configuration (:class:`pigeon.broker.BrokerConfig` or the
        bookie's, with the ``token_*``/``tls_*`` keys) — returns a
        :class:`pigeon.core.auth.AuthenticationProvider`: an ``auth_method`` (the name a
        client gives in its handshake) and ``authenticate(AuthData) -> role``, which raises
        :class:`pigeon.core.errors.AuthenticationError` (never quoting the secret).  A node
        enables the providers its ``authentication_providers`` setting names.

    Called for every plugin when the node's plugin manager is built; not firstresult.
    """


@hookspec
def pigeon_ledger_storages(registry: Registry[Any]) -> None:
    """Register a bookie's ledger storage backends by name (``segment-files``,
    ``journal``, ...).

    :param registry: call ``registry.register(name, factory)``; ``factory(config)`` —
        ``config`` the bookie's :class:`pigeon.bookie.BookieConfig` (its ``data_dir``,
        ``fsync`` and the backend's own keys) — returns a
        :class:`pigeon.core.storage.LedgerStorage` that is not running yet.  A bookie
        uses the backend its ``ledger_storage`` setting (``pigeon bookie --storage
        NAME``) names.  Every backend passes the contract suite
        :class:`pigeon.core.testing.LedgerStorageContract`.

    Called for every plugin when the node's plugin manager is built; not firstresult.
    """


@hookspec
def pigeon_offloaders(registry: Registry[Any]) -> None:
    """Register a broker's offloaders by driver name (``filesystem``, ``s3``, ...): where
    tiered storage copies closed segments.

    :param registry: call ``registry.register(name, factory)``; ``factory(config)`` —
        ``config`` the broker's :class:`pigeon.broker.BrokerConfig` (its
        ``managed_ledger_offload_*`` and the driver's own keys) — returns a
        :class:`pigeon.core.offload.Offloader`.  A broker uses the driver its
        ``managed_ledger_offload_driver`` setting names (none when it is empty).
        :class:`pigeon.core.offload.BlobOffloader` implements the contract over four
        object-store primitives.

    Called for every plugin when the node's plugin manager is built; not firstresult.
    """


# -- command line ----------------------------------------------------------------------


@hookspec
def pigeon_cli_commands(group: click.Group) -> None:
    """Add subcommands to the ``pigeon`` command.

    :param group: the root click group; call ``group.add_command(cmd)``.

    Called once when the ``pigeon`` command starts; not firstresult.
    """
