"""Ownership claims: the Claim state machine against a model store, and Ownership against
the real embedded metadata store, where a node left by a broker's earlier run vanishes
between the steps of a claim (the restart race that made a broker exit with NoSuchNode).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pigeon.broker._ownership import BROKERS_PATH, Claim, ClaimStep, Ownership
from pigeon.core import TopicName
from pigeon.core.errors import MetadataError, NotOwner
from pigeon.core.metadata import EmbeddedMetadataStore, EventType, MetadataStore

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


def test_the_node_of_an_earlier_run_is_replaced() -> None:
    claim = Claim(URL, "t2")
    claim.exists()
    claim.read(holder(URL, "t1"), 4)
    assert (claim.step, claim.version) == (ClaimStep.DELETE, 4)
    claim.deleted()
    assert claim.step is ClaimStep.CREATE  # the first retry comes at once
    claim.created()
    assert claim.step is ClaimStep.HELD and claim.stale_deleted == 1


def test_an_old_node_that_expires_before_the_delete_is_no_error() -> None:
    """The restart race: NodeExists, then the old session expires, then NoSuchNode."""
    claim = Claim(URL, "t2")
    claim.exists()
    claim.read(holder(URL, "t1"), 0)
    claim.deleted(missing=True)
    assert claim.step is ClaimStep.CREATE
    claim.created()
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
    claim = Claim(URL, "t2", attempts=6, backoff_s=0.1, max_backoff_s=0.3)
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
    )
    def start(self, start: str) -> None:
        self.token = "now"
        # the node: (url, token, version) or None
        self.node: tuple[str, str, int] | None = {
            "free": None,
            "stale": (URL, "before", 0),
            "ours": (URL, "now", 0),  # created by this session, answer lost
            "other": (OTHER, "x", 0),
        }[start]
        self.claim = Claim(URL, self.token, attempts=self.ATTEMPTS)
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
            if self.node is None:
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

    @precondition(lambda self: not self.claim.done)
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
        if self.node is None:
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
            assert self.interferences >= self.ATTEMPTS - 1


ClaimMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
test_claim_against_model = ClaimMachine.TestCase


# ---------------------------------------------------------------------- real store


class FlakyStore:
    """A store that runs ``before(op)`` ahead of chosen operations: the world changing
    between the steps of a claim."""

    def __init__(self, store: MetadataStore) -> None:
        self._store = store
        self.hooks: dict[str, Callable[[], Awaitable[None]]] = {}
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def _op(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(name)
        hook = self.hooks.pop(name, None)
        if hook is not None:
            await hook()
        return await getattr(self._store, name)(*args, **kwargs)

    async def create(self, *args: Any, **kwargs: Any) -> Any:
        return await self._op("create", *args, **kwargs)

    async def get(self, *args: Any, **kwargs: Any) -> Any:
        return await self._op("get", *args, **kwargs)

    async def delete(self, *args: Any, **kwargs: Any) -> Any:
        return await self._op("delete", *args, **kwargs)


MetadataStoreFactory = Callable[[], Any]
ExpireSession = Callable[[MetadataStore], Awaitable[None]]

TOPIC = TopicName.parse("persistent://public/default/orders")


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
            old = Ownership(old_store, URL, "127.0.0.1:6650")
            await old.register()
            await old.acquire(TOPIC)
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
        """The earlier run's session has not expired yet: its nodes are replaced, so that
        their expiry later cannot take the new run's registration or bundles away."""
        async with metadata_store_factory() as store:
            async with metadata_store_factory() as old_store:
                old = Ownership(old_store, URL, "127.0.0.1:6650")
                await old.register()
                await old.acquire(TOPIC)
                new = Ownership(store, URL, "127.0.0.1:6650")
                await new.register()
                await new.acquire(TOPIC)
                assert new.takeovers == 2
            # the old store closed (its session ended): the new run's nodes remain
            for path in (f"{BROKERS_PATH}/127.0.0.1:6650", new.path_of(TOPIC)):
                stat = await store.get(path)
                assert stat is not None, path
                assert json.loads(stat.value)["token"] == new.token

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

    async def test_a_registration_held_by_another_broker_is_an_error(
        self, metadata_store_factory: MetadataStoreFactory
    ) -> None:
        async with metadata_store_factory() as a_store, metadata_store_factory() as b_store:
            await Ownership(a_store, OTHER, "127.0.0.1:6650").register()
            with pytest.raises(MetadataError, match="registered by another broker"):
                await Ownership(b_store, URL, "127.0.0.1:6650").register()


@asynccontextmanager
async def running(store: EmbeddedMetadataStore) -> AsyncIterator[EmbeddedMetadataStore]:
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        yield store
        nursery.cancel_scope.cancel()


class TestOwnershipEmbedded(OwnershipContract):
    @pytest.fixture
    def metadata_store_factory(self, tmp_path: Path) -> MetadataStoreFactory:
        def factory() -> Any:
            return running(EmbeddedMetadataStore(tmp_path))

        return factory

    @pytest.fixture
    def expire_session(self) -> ExpireSession:
        async def expire(store: MetadataStore) -> None:
            assert isinstance(store, EmbeddedMetadataStore)
            await store.expire_session()

        return expire
