"""Simulated members of a Kafka consumer group, for the group coordinator's tests.

Every simulated leader assigns each member ``{member_id}@{generation}``, so a test can
tell who got what in which generation.
"""

from __future__ import annotations

from pigeon.broker._kafka_group import GroupCoordinator, JoinResult


def assignment_of(member_id: str, generation: int) -> bytes:
    """What the tests' assignor gives ``member_id`` in ``generation``."""
    return f"{member_id}@{generation}".encode()


def assign(result: JoinResult) -> list[tuple[str, bytes]]:
    """The leader's SyncGroup assignments for the members of ``result``."""
    return [(m.member_id, assignment_of(m.member_id, result.generation_id)) for m in result.members]


class SimulatedMember:
    """A consumer's identity in the group and the assignment it last synced."""

    def __init__(self, coordinator: GroupCoordinator, name: str) -> None:
        self.coordinator = coordinator
        self.name = name
        self.member_id = ""
        self.generation = -1
        self.assignment = b""

    def owns_its_assignment(self, generation: int) -> bool:
        """In ``generation``, holding what the leader assigned it there."""
        return self.generation == generation and self.assignment == assignment_of(
            self.member_id, generation
        )
