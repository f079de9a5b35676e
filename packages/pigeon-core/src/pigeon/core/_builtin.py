"""Built-in plugins, registered through the same hooks as external ones."""

from __future__ import annotations

from typing import Any

import pluggy

from pigeon.core._plugins import Registry

hookimpl = pluggy.HookimplMarker("pigeon")


@hookimpl
def pigeon_metadata_stores(registry: Registry[Any]) -> None:
    from pigeon.core.metadata import EmbeddedMetadataStore

    registry.register("embedded", EmbeddedMetadataStore.from_url)


@hookimpl
def pigeon_codecs(registry: Registry[Any]) -> None:
    from pigeon.core._codecs import GZIP, NONE

    registry.register(NONE.name, NONE)
    registry.register(GZIP.name, GZIP)


@hookimpl
def pigeon_replication_policies(registry: Registry[Any]) -> None:
    from pigeon.core._replication import QuorumPolicy

    registry.register("quorum", QuorumPolicy)


@hookimpl
def pigeon_authentication_providers(registry: Registry[Any]) -> None:
    from pigeon.core.auth import TlsAuthenticationProvider, TokenAuthenticationProvider

    registry.register("token", TokenAuthenticationProvider.from_settings)
    registry.register("tls", TlsAuthenticationProvider.from_settings)
