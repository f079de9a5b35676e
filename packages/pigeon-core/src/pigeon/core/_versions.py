"""Which PigeonMQ distributions are installed, and their versions (``pigeon --version``).

Each package has one version, ``version`` in its ``pyproject.toml``; once installed it is
read back from the distribution's metadata (``importlib.metadata``), never written twice.
"""

from __future__ import annotations

import re
from importlib import metadata

__all__ = ["CORE_DISTRIBUTION", "installed_distributions"]

#: the distribution every other PigeonMQ distribution builds on
CORE_DISTRIBUTION = "pigeon-core"
#: the entry-point group plugins register in (as in :mod:`pigeon.core._plugins`)
_PLUGIN_GROUP = "pigeon"
_REQUIREMENT_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_distributions() -> list[tuple[str, str]]:
    """``(name, version)`` of each installed PigeonMQ distribution: ``pigeon-core`` first,
    then, by name, every distribution that registers a PigeonMQ plugin or requires (directly
    or through another) a PigeonMQ distribution: the packages, the plugins, third-party
    plugins.  Where a distribution is found twice on ``sys.path``, the first wins, as for
    imports."""
    found: dict[str, metadata.Distribution] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(_normalize(name), dist)
    ours = {
        name
        for name, dist in found.items()
        if name == CORE_DISTRIBUTION or any(ep.group == _PLUGIN_GROUP for ep in dist.entry_points)
    }
    requires = {
        name: {
            _normalize(m.group(1))
            for req in dist.requires or ()
            if (m := _REQUIREMENT_NAME.match(req))
        }
        for name, dist in found.items()
    }
    grown = True
    while grown:  # bounded: each pass adds at least one of the finitely many distributions
        more = {name for name, needs in requires.items() if name not in ours and needs & ours}
        ours |= more
        grown = bool(more)
    order = sorted(ours, key=lambda name: (name != CORE_DISTRIBUTION, name))
    return [(found[name].metadata["Name"], found[name].version) for name in order]
