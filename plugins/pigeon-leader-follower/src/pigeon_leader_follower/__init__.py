"""Leader-follower replication for PigeonMQ segments (policy name ``leader-follower``).

Installing this distribution registers the policy through the ``pigeon`` entry-point
group; a broker started with ``--replication leader-follower`` (or ``replication =
"leader-follower"`` in its ``[broker]`` table) writes every new segment with it.  The
bookies forward entries to the followers themselves (``pigeon-bookie`` >= 0.1), so the
brokers' outgoing traffic is one copy per entry whatever the replica count.
"""

from __future__ import annotations

from typing import Any

import pluggy

from pigeon.core import Registry
from pigeon_leader_follower._policy import LeaderFollowerPolicy, LeaderFollowerWriter

__all__ = ["LeaderFollowerPolicy", "LeaderFollowerWriter", "pigeon_replication_policies"]

hookimpl = pluggy.HookimplMarker("pigeon")


@hookimpl
def pigeon_replication_policies(registry: Registry[Any]) -> None:
    registry.register(LeaderFollowerPolicy.name, LeaderFollowerPolicy)
