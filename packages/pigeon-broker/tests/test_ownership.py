"""Ownership claims: the Claim state machine against a model store, and Ownership against
the real embedded metadata store, where a node left by a broker's earlier run vanishes
between the steps of a claim (the restart race that made a broker exit with NoSuchNode).
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pigeon.broker._ownership import (
    AddressTaken,
    Claim,
    ClaimStep,
    Ownership,
    TakeOver,
)
from pigeon.core import TopicName
from pigeon.core.errors import MetadataError, NotOwner
from pigeon.core.metadata import EmbeddedMetadataStore, EventType, MetadataStore
from pigeon.core.paths import BROKER_SESSIONS_PATH, BROKERS_PATH
from pigeon.core.testing import ExpireSession, MetadataStoreFactory, store_factory

URL = "pigeon://127.0.0.1:6650"
OTHER = "pigeon://127.0.0.1:6651"


def holder(url: str, token: str) -> bytes:
    return json.dumps({"url": url, "address": url[9:], "token": token}).encode()


# ---------------------------------------------------------------------- Claim, by hand


def test_a_free_node_is_created() -> None:
    claim = Claim(URL, "t1")
    assert claim.step is ClaimStep.CREATE
    claim.created()
    assert claim.step is ClaimStep.HELD and not claim.adopted and claim.rounds == 0


def test_our_own_node_is_kept() -> None:
    """A create of this session that succeeded although its answer was lost, or a
    concurrent claim of the same bundle that won: held as it is, never deleted."""
    claim = Claim(URL, "t1")
    claim.exists()
    claim.read(holder(URL, "t1"), 3)
    assert claim.step is ClaimStep.HELD and claim.adopted


def test_the_node_of_an_earlier_run_is_replaced_when_taking_over() -> None:
    claim = Claim(URL, "t2", take_over=TakeOver.ALWAYS)
    claim.exists()
    claim.read(holder(URL, "t1"), 4)
    assert (claim.step, claim.version) == (ClaimStep.DELETE, 4)
    claim.deleted()
    assert claim.step is ClaimStep.CREATE  # the first retry comes at once
    claim.created()
    assert claim.step is ClaimStep.HELD and claim.stale_deleted == 1


def test_an_old_node_that_expires_before_the_delete_is_no_error() -> None:
    """The restart race: NodeExists, then the old session expires, then NoSuchNode."""
    claim = Claim(URL, "t2", take_over=TakeOver.ALWAYS)
    claim.exists()
    claim.read(holder(URL, "t1"), 0)
    claim.deleted(missing=True)
    assert claim.step is ClaimStep.CREATE
    claim.created()
    assert claim.step is ClaimStep.HELD and claim.stale_deleted == 0


def test_an_anchored_take_over_names_the_earlier_session() -> None:
    """A bundle: another broker may claim it the moment the old node expires, at the
    same version 0, so the delete must hold only while the old session is alive."""
    claim = Claim(URL, "t2")
    claim.exists()
    claim.read(holder(URL, "t1"), 5)
    assert (claim.step, claim.version, claim.anchor) == (ClaimStep.DELETE, 5, "t1")
    claim.deleted(missing=True)  # its marker was gone: the session expired
    assert claim.step is ClaimStep.CREATE and claim.anchor is None
    claim.created()
    assert claim.step is ClaimStep.HELD and claim.stale_deleted == 0


def test_a_node_with_nothing_to_anchor_on_is_left_to_expire() -> None:
    claim = Claim(URL, "t2")
    claim.exists()
    claim.read(json.dumps({"url": URL}).encode(), 0)  # no token: no session marker
    assert claim.step is ClaimStep.CREATE and claim.waiting_for_expiry
    claim = Claim(URL, "t2", take_over=TakeOver.NEVER, attempts=4, backoff_s=0.1)
    waits = []
    while not claim.done:
        if claim.step is ClaimStep.CREATE:
            claim.exists()
        elif claim.step is ClaimStep.READ:
            claim.read(holder(URL, "t1"), 0)
        elif claim.step is ClaimStep.WAIT:
            waits.append(claim.delay)
            claim.waited()
        else:
            raise AssertionError(f"a NEVER claim must not {claim.step}")
    assert claim.step is ClaimStep.GAVE_UP and claim.waiting_for_expiry
    assert waits == [0.1, 0.2]
    claim = Claim(URL, "t2", take_over=TakeOver.NEVER)
    claim.exists()
    claim.read(holder(URL, "t1"), 0)
    claim.created()  # it expired meanwhile
    assert claim.step is ClaimStep.HELD and claim.stale_deleted == 0


def test_an_old_node_that_expires_before_the_read_is_no_error() -> None:
    claim = Claim(URL, "t2")
    claim.exists()
    claim.read(None)
    assert claim.step is ClaimStep.CREATE
    claim.created()
    assert claim.step is ClaimStep.HELD


def test_another_brokers_node_is_refused() -> None:
    claim = Claim(URL, "t1")
    claim.exists()
    claim.read(holder(OTHER, "x"), 0)
    assert claim.step is ClaimStep.REFUSED and claim.owner == OTHER
    claim = Claim(URL, "t1")
    claim.exists()
    claim.read(b"not json", 0)  # names no holder: not ours to delete
    assert claim.step is ClaimStep.REFUSED


def test_retries_back_off_and_are_bounded() -> None:
    claim = Claim(
        URL, "t2", take_over=TakeOver.ALWAYS, attempts=6, backoff_s=0.1, max_backoff_s=0.3
    )
    delays = []
    while not claim.done:
        if claim.step is ClaimStep.CREATE:
            claim.exists()
        elif claim.step is ClaimStep.READ:
            claim.read(holder(URL, "t1"), 0)  # an earlier run re-creates it every time
        elif claim.step is ClaimStep.DELETE:
            claim.deleted()
        else:
            delays.append(claim.delay)
            claim.waited()
    assert claim.step is ClaimStep.GAVE_UP and claim.rounds == 6
    assert delays == [0.1, 0.2, 0.3, 0.3]


def test_steps_out_of_order_are_refused() -> None:
    claim = Claim(URL, "t1")
    with pytest.raises(RuntimeError):
        claim.read(None)


# ---------------------------------------------------------------------- Claim vs a model


class ClaimMachine(RuleBasedStateMachine):
    """One claim, stepped against a model of the node, while the world changes between
    its steps: the earlier run's session expires, another broker grabs a free node, an
    earlier run (still alive for a moment) rewrites its node.

    Safety: a claim never deletes a node that is not a stale one of ours, is held only
    while the node is ours, is refused only after reading another broker's node, and
    ends within its round budget."""

    ATTEMPTS = 8

    @initialize(
        start=st.sampled_from(["free", "stale", "ours", "other"]),
        take_over=st.sampled_from(TakeOver),
    )
    def start(self, start: str, take_over: TakeOver) -> None:
        # ALWAYS: a registration (no other broker may hold this address); otherwise a
        # bundle, which another broker may grab whenever it is free
        self.take_over = take_over
        self.old_alive = start == "stale"  # the earlier run's session (and its marker)
        self.token = "now"
        # the node: (url, token, version) or None
        self.node: tuple[str, str, int] | None = {
            "free": None,
            "stale": (URL, "before", 0),
            "ours": (URL, "now", 0),  # created by this session, answer lost
            "other": (OTHER, "x", 0),
        }[start]
        self.claim = Claim(URL, self.token, take_over=take_over, attempts=self.ATTEMPTS)
        self.refused_after_reading: tuple[str, str, int] | None = None
        self.steps = 0
        self.interferences = 0

    # -- the claim's own steps, performed on the model
    @precondition(lambda self: not self.claim.done)
    @rule()
    def step(self) -> None:
        self.steps += 1
        claim = self.claim
        if claim.step is ClaimStep.CREATE:
            if self.node is None:
                self.node = (URL, self.token, 0)
                claim.created()
            else:
                claim.exists()
        elif claim.step is ClaimStep.READ:
            if self.node is None:
                claim.read(None)
            else:
                url, token, version = self.node
                claim.read(holder(url, token), version)
                if claim.step is ClaimStep.REFUSED:
                    self.refused_after_reading = self.node
        elif claim.step is ClaimStep.DELETE:
            assert self.take_over is not TakeOver.NEVER, "a NEVER claim deleted a node"
            if claim.anchor is not None and not (self.old_alive and claim.anchor == "before"):
                claim.deleted(missing=True)  # the multi's check of the marker failed
            elif self.node is None:
                claim.deleted(missing=True)
            elif self.node[2] != claim.version:
                claim.deleted(changed=True)
            else:
                url, token, _ = self.node
                assert url == URL and token != self.token, f"deleted a live node {self.node}"
                self.node = None
                claim.deleted()
        else:
            assert 0 <= claim.delay <= claim.max_backoff_s
            claim.waited()

    # -- the world
    @rule()
    def old_session_expires(self) -> None:
        if self.node is not None and self.node[0] == URL and self.node[1] != self.token:
            self.node = None
            self.interferences += 1
        self.old_alive = False

    @precondition(lambda self: not self.claim.done and self.take_over is not TakeOver.ALWAYS)
    @rule()
    def other_broker_grabs_a_free_node(self) -> None:
        if self.node is None:
            self.node = (OTHER, "x", 0)
            self.interferences += 1

    @precondition(lambda self: not self.claim.done)
    @rule()
    def earlier_run_rewrites_its_node(self) -> None:
        if self.node is not None and self.node[0] == URL and self.node[1] != self.token:
            self.node = (URL, self.node[1], self.node[2] + 1)
            self.interferences += 1

    @precondition(lambda self: not self.claim.done)
    @rule()
    def earlier_run_recreates_its_node(self) -> None:
        if self.node is None and self.old_alive:
            self.node = (URL, "before", 0)
            self.interferences += 1

    # -- what must hold
    @invariant()
    def held_means_ours(self) -> None:
        if self.claim.step is ClaimStep.HELD:
            assert self.node == (URL, self.token, self.node[2] if self.node else 0)

    @invariant()
    def refused_means_another_broker(self) -> None:
        if self.claim.step is ClaimStep.REFUSED:
            assert self.refused_after_reading is not None
            assert self.refused_after_reading[0] != URL

    @invariant()
    def bounded(self) -> None:
        assert self.claim.rounds <= self.ATTEMPTS
        assert self.steps <= 4 * self.ATTEMPTS + 2

    @invariant()
    def gives_up_only_when_disturbed(self) -> None:
        if self.claim.step is ClaimStep.GAVE_UP:
            # or a bundle's earlier-run node that did not expire within the claim's rounds
            assert self.interferences >= self.ATTEMPTS - 1 or (
                self.take_over is TakeOver.NEVER and self.claim.waiting_for_expiry
            )


ClaimMachine.TestCase.settings = settings(max_examples=500, stateful_step_count=40, deadline=None)
test_claim_against_model = ClaimMachine.TestCase


@pytest.mark.parametrize("take_over", [TakeOver.ANCHORED, TakeOver.NEVER])
def test_claim_model_old_node_expires_and_another_broker_claims(take_over: TakeOver) -> None:
    """The interleaving that a plain version-checked delete gets wrong, spelled out:
    the earlier run's node expires right after the claim read it, and another broker
    creates the bundle's node at version 0 before the claim's delete."""
    machine = ClaimMachine()
    machine.start(start="stale", take_over=take_over)
    machine.step()  # create: NodeExists
    machine.step()  # read: an earlier run's node
    machine.old_session_expires()
    machine.other_broker_grabs_a_free_node()
    while not machine.claim.done:
        machine.step()
        machine.held_means_ours()
        machine.bounded()
    assert machine.claim.step is ClaimStep.REFUSED
    assert machine.node == (OTHER, "x", 0)


# ---------------------------------------------------------------------- real store


class FlakyStore:
    """A store that runs a hook ahead of a chosen operation (by name, or by its index
    among the calls): the world changing between the steps of a claim."""

    def __init__(self, store: MetadataStore) -> None:
        self._store = store
        self.hooks: dict[str | int, Callable[[], Awaitable[None]]] = {}
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def _op(self, name: str, *args: Any, **kwargs: Any) -> Any:
        index = len(self.calls)
        self.calls.append(name)
        for key in (index, name):
            hook = self.hooks.pop(key, None)
            if hook is not None:
                await hook()
        return await getattr(self._store, name)(*args, **kwargs)

    async def create(self, *args: Any, **kwargs: Any) -> Any:
        return await self._op("create", *args, **kwargs)

    async def get(self, *args: Any, **kwargs: Any) -> Any:
        return await self._op("get", *args, **kwargs)

    async def delete(self, *args: Any, **kwargs: Any) -> Any:
        return await self._op("delete", *args, **kwargs)


TOPIC = TopicName.parse("persistent://public/default/orders")


async def _owner_of_topic(store: Any) -> Ownership:
    """This broker (``URL``) registered on ``store`` and owning ``TOPIC``."""
    owner = Ownership(store, URL, "127.0.0.1:6650")
    await owner.register()
    await owner.acquire(TOPIC)
    return owner


class OwnershipContract:
    """Ownership across broker restarts, against a real metadata store: subclass it with
    ``metadata_store_factory`` and ``expire_session`` fixtures, as for
    :class:`pigeon.core.testing.MetadataStoreContract`."""

    async def test_restart_while_the_old_session_expires_before_the_delete(
        self, metadata_store_factory: MetadataStoreFactory, expire_session: ExpireSession
    ) -> None:
        """NodeExists (the earlier run's node), then the earlier run's session expires,
        then the delete finds no node: the broker registers, it does not exit."""
        async with metadata_store_factory() as old_store, metadata_store_factory() as store:
            old = Ownership(old_store, URL, "127.0.0.1:6650")
            await old.register()
            flaky = FlakyStore(store)

            async def old_run_expires() -> None:
                await expire_session(old_store)

            flaky.hooks["delete"] = old_run_expires
            new = Ownership(flaky, URL, "127.0.0.1:6650")
            await new.register()
            assert flaky.calls[:4] == ["create", "get", "delete", "create"]
            stat = await store.get(f"{BROKERS_PATH}/127.0.0.1:6650")
            assert stat is not None and stat.ephemeral
            assert json.loads(stat.value)["token"] == new.token
            assert (await new.brokers()).keys() == {"127.0.0.1:6650"}

    async def test_restart_while_the_old_session_expires_before_the_read(
        self, metadata_store_factory: MetadataStoreFactory, expire_session: ExpireSession
    ) -> None:
        async with metadata_store_factory() as old_store, metadata_store_factory() as store:
            await _owner_of_topic(old_store)  # the old run of this broker
            flaky = FlakyStore(store)

            async def old_run_expires() -> None:
                await expire_session(old_store)

            flaky.hooks["get"] = old_run_expires
            new = Ownership(flaky, URL, "127.0.0.1:6650")
            await new.acquire(TOPIC)
            assert new.owns(TOPIC)
            assert flaky.calls == ["create", "get", "create"]
            stat = await store.get(new.path_of(TOPIC))
            assert stat is not None and json.loads(stat.value)["token"] == new.token

    async def test_restart_takes_over_the_earlier_runs_nodes(
        self, metadata_store_factory: MetadataStoreFactory
    ) -> None:
        """The earlier run's session has not expired yet: its registration and bundles
        are taken over at once (no wait for the session timeout), so that their expiry
        later cannot take the new run's nodes away."""
        async with metadata_store_factory() as store:
            new = Ownership(store, URL, "127.0.0.1:6650")
            async with metadata_store_factory() as old_store:
                await _owner_of_topic(old_store)  # the old run of this broker
                await new.register()
                await new.acquire(TOPIC)
                assert new.takeovers == 2 and new.owns(TOPIC)
            # the old store closed (its session ended): the new run's nodes remain
            for path in (f"{BROKERS_PATH}/127.0.0.1:6650", new.path_of(TOPIC)):
                stat = await store.get(path)
                assert stat is not None, path
                assert json.loads(stat.value)["token"] == new.token
            assert await store.children(BROKER_SESSIONS_PATH) == [new.token]

    async def test_a_bundle_of_a_run_without_a_session_marker_waits_for_its_expiry(
        self, metadata_store_factory: MetadataStoreFactory
    ) -> None:
        async with metadata_store_factory() as store:
            new = Ownership(store, URL, "127.0.0.1:6650")
            async with metadata_store_factory() as old_store:
                old = Ownership(old_store, URL, "127.0.0.1:6650")
                await old.acquire(TOPIC)  # never registered: nothing to anchor on
                with pytest.raises(NotOwner, match="earlier run of this broker") as info:
                    await new.acquire(TOPIC)
                assert info.value.retriable and not new.owns(TOPIC)
            await new.acquire(TOPIC)  # the old session ended
            assert new.owns(TOPIC)

    async def test_a_bundle_taken_by_another_broker_as_the_old_node_expires_is_kept(
        self, metadata_store_factory: MetadataStoreFactory, expire_session: ExpireSession
    ) -> None:
        """Right after the restarted broker read its earlier run's node, that node
        expires and another broker claims the bundle, at version 0 again. A plain
        version-checked delete of "the old node" would remove the other broker's node
        and leave two brokers serving the bundle; the delete anchored on the old
        session's marker fails instead."""
        async with (
            metadata_store_factory() as old_store,
            metadata_store_factory() as other_store,
            metadata_store_factory() as store,
        ):
            await _owner_of_topic(old_store)  # the old run of this broker
            other = Ownership(other_store, OTHER, "127.0.0.1:6651")
            flaky = FlakyStore(store)

            async def old_expires_and_other_claims() -> None:
                await expire_session(old_store)
                await other.acquire(TOPIC)

            flaky.hooks[2] = old_expires_and_other_claims  # after create, get
            new = Ownership(flaky, URL, "127.0.0.1:6650")
            with pytest.raises(NotOwner, match=re.escape(f"served by {OTHER}")):
                await new.acquire(TOPIC)
            stat = await store.get(new.path_of(TOPIC))
            assert stat is not None and json.loads(stat.value)["token"] == other.token

    async def test_another_brokers_bundle_is_refused(
        self, metadata_store_factory: MetadataStoreFactory
    ) -> None:
        async with metadata_store_factory() as a_store, metadata_store_factory() as b_store:
            a = Ownership(a_store, URL, "127.0.0.1:6650")
            b = Ownership(b_store, OTHER, "127.0.0.1:6651")
            await a.acquire(TOPIC)
            with pytest.raises(NotOwner, match=re.escape("served by pigeon://127.0.0.1:6650")):
                await b.acquire(TOPIC)
            assert a.owns(TOPIC) and not b.owns(TOPIC)

    async def test_concurrent_claims_of_one_bundle_never_release_it(
        self, metadata_store_factory: MetadataStoreFactory
    ) -> None:
        """Two topics of one bundle opened at once on one broker: the second claim finds
        the first's node and keeps it. (Deleting it to create it again would leave the
        bundle free for a moment, for another broker to take while this one serves.)"""
        async with metadata_store_factory() as store:
            ownership = Ownership(store, URL, "127.0.0.1:6650")
            path = ownership.path_of(TOPIC)
            async with store.watch(path) as events:
                async with trio.open_nursery() as nursery:
                    for _ in range(4):
                        nursery.start_soon(ownership.acquire, TOPIC)
                assert ownership.owns(TOPIC)
                seen = []
                with trio.move_on_after(0.5):
                    async for event in events:
                        seen.append(event.type)
            assert seen == [EventType.CREATED]

    async def test_a_claim_that_loses_its_session_is_not_held(
        self, metadata_store_factory: MetadataStoreFactory, expire_session: ExpireSession
    ) -> None:
        async with metadata_store_factory() as store:
            flaky = FlakyStore(store)
            ownership = Ownership(flaky, URL, "127.0.0.1:6650")

            async def session_lost() -> None:
                ownership.token = "next-session"  # what Ownership.run does on expiry

            flaky.hooks["create"] = session_lost
            with pytest.raises(NotOwner, match="try again"):
                await ownership.acquire(TOPIC)
            assert not ownership.owns(TOPIC)

    async def test_a_claim_while_the_session_is_expired_is_retriable(
        self, metadata_store_factory: MetadataStoreFactory, expire_session: ExpireSession
    ) -> None:
        """Not SessionExpired (final for a client) but NotOwner: look it up again."""
        async with metadata_store_factory() as store:
            ownership = Ownership(store, URL, "127.0.0.1:6650")
            await expire_session(store)
            with pytest.raises(NotOwner, match="session lost") as info:
                await ownership.acquire(TOPIC)
            assert info.value.retriable

    async def test_a_registration_held_by_another_broker_is_an_error(
        self, metadata_store_factory: MetadataStoreFactory
    ) -> None:
        async with metadata_store_factory() as a_store, metadata_store_factory() as b_store:
            await Ownership(a_store, OTHER, "127.0.0.1:6650").register()
            with pytest.raises(MetadataError, match="registered by another broker"):
                await Ownership(b_store, URL, "127.0.0.1:6650").register()

    async def test_a_broker_started_during_a_metadata_hiccup_registers_once_it_is_over(
        self, metadata_store_factory: MetadataStoreFactory, expire_session: ExpireSession
    ) -> None:
        """Found by the nemesis (zlf 5004): a broker restarted while ZooKeeper dropped
        its connection exited on the failed registration, and its layer ran a broker
        short.  Registration at start waits a lost connection and a lost session out."""
        async with metadata_store_factory() as store:
            flaky = FlakyStore(store)

            async def connection_loss() -> None:
                raise MetadataError("metadata write: ConnectionLoss")

            async def session_loss() -> None:
                await expire_session(store)

            flaky.hooks[0] = connection_loss
            flaky.hooks[1] = session_loss
            ownership = Ownership(flaky, URL, "127.0.0.1:6650")
            async with trio.open_nursery() as nursery:
                with trio.fail_after(10):
                    await nursery.start(ownership.run, lambda: None)
                assert await store.get(f"{BROKERS_PATH}/127.0.0.1:6650") is not None
                nursery.cancel_scope.cancel()

    async def test_a_broker_whose_address_another_broker_holds_does_not_start(
        self, metadata_store_factory: MetadataStoreFactory
    ) -> None:
        async with metadata_store_factory() as a_store, metadata_store_factory() as b_store:
            await Ownership(a_store, OTHER, "127.0.0.1:6650").register()
            with trio.fail_after(10), pytest.raises(AddressTaken):
                await Ownership(b_store, URL, "127.0.0.1:6650").run(lambda: None)


class TestOwnershipEmbedded(OwnershipContract):
    @pytest.fixture
    def metadata_store_factory(self, tmp_path: Path) -> MetadataStoreFactory:
        return store_factory(lambda: EmbeddedMetadataStore(tmp_path))

    @pytest.fixture
    def expire_session(self) -> ExpireSession:
        async def expire(store: MetadataStore) -> None:
            assert isinstance(store, EmbeddedMetadataStore)
            await store.expire_session()

        return expire
