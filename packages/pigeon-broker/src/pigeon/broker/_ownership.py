"""Topic ownership: namespace bundles held through ephemeral nodes, and broker lookups.

Each namespace's hash space is split into ``bundles_per_namespace`` equal bundles; a topic
belongs to the bundle its name's CRC-32 falls in. A broker serves a topic only while it
holds its bundle's ephemeral node ``/pigeon/ownership/<tenant>/<ns>/<bundle>`` (value: the
broker's service URL, and ``url_tls``, its ``pigeon+ssl://`` URL when it has a TLS
listener). When a broker dies its metadata session expires, the nodes vanish,
and the next lookup hands the bundle to another broker, which recovers (fences) the
topics' last segments before appending: no data moves.

Brokers register at ``/pigeon/brokers/available/<host:port>`` with a small load report;
a lookup for an unowned bundle proposes the least-loaded broker, and that broker claims
the bundle when the first producer or consumer arrives.

Both nodes are taken through a :class:`Claim`, a plain state machine (no I/O) that
:meth:`Ownership._hold` drives.  Every node value carries the broker's ``token``, new for
each metadata session, so that a claim can tell its own node (a create that succeeded
although the answer was lost, a concurrent claim of the same bundle: kept) from one left
by an earlier run or session of the same broker (taken over) and from another broker's
(refused).  A node that vanishes between create, read and delete (its session expired
meanwhile) is no error: the claim creates again.  Rounds are bounded, with backoff.

Taking over an earlier run's node must not delete anything else: versions restart at 0
when a node is created again, so "delete at the version read" cannot tell the old node
from one that another broker created the moment the old one expired.  Each broker session
therefore holds a marker ``/pigeon/brokers/sessions/<token>``; an earlier run's bundle is
deleted by ``multi([check(its marker), delete(node, version)])``, which succeeds only
while that run's session (marker and node alike) is alive.  Without a marker the claim
waits for the node to expire.  A registration is keyed by this broker's own address, which
no other broker can hold: it is taken over by a version-checked delete.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import secrets
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import trio

from pigeon.core import TopicName
from pigeon.core.errors import (
    BadVersion,
    MetadataError,
    NodeExists,
    NoSuchNode,
    NotOwner,
    PigeonError,
    SessionExpired,
    TlsError,
)
from pigeon.core.metadata import Op
from pigeon.core.paths import BROKER_SESSIONS_PATH, BROKERS_PATH, OWNERSHIP_PATH

__all__ = [
    "AddressTaken",
    "Claim",
    "ClaimStep",
    "Ownership",
    "TakeOver",
]

log = logging.getLogger(__name__)

FULL_RANGE = 1 << 32
#: first and longest wait between attempts to register at start
REGISTER_RETRY_S = (0.1, 2.0)


class AddressTaken(MetadataError):
    """This broker's address is registered by another broker (not worth retrying)."""

    retriable = False


# ---------------------------------------------------------------------- claim (no I/O)


class TakeOver(enum.Enum):
    """How a claim treats a node of an earlier run or session of the same broker."""

    ALWAYS = "always"  #: delete it at the version read (a node only we may create)
    ANCHORED = "anchored"  #: delete it only while its session's marker exists
    NEVER = "never"  #: wait for it to expire


class ClaimStep(enum.Enum):
    """What the driver of a :class:`Claim` does next."""

    CREATE = "create"  #: create the ephemeral node; report created() / exists()
    READ = "read"  #: read it; report read(value, version) (value None: no node)
    DELETE = "delete"  #: delete it at ``claim.version``, only while the marker of session
    #: ``claim.anchor`` exists if that is not None; report deleted(...)
    WAIT = "wait"  #: sleep ``claim.delay`` seconds; report waited()
    HELD = "held"  #: done: the node is ours (``claim.adopted``: it already was)
    REFUSED = "refused"  #: done: another broker (``claim.owner``) holds it
    GAVE_UP = "gave_up"  #: done: no stable outcome within ``attempts`` rounds


@dataclass(eq=False)
class Claim:
    """How to come to hold one ephemeral node whose value is a JSON object naming its
    holder by ``url`` and ``token``; no I/O (the driver performs each step).

    * Our ``token``: the node is this session's (an earlier create of ours whose answer
      was lost, or a concurrent claim of ours won): **held**, nothing to do.
    * Our ``url``, another token (an earlier run, or an expired session of this broker):
      per ``take_over``, delete it at the version read (``ALWAYS``), or only while the
      marker of its session exists (``ANCHORED``; ``anchor`` names that session), then
      create again; or wait for it to expire (``NEVER``, or no token to anchor on).
    * Another ``url`` (or a value that names no holder): **refused**.
    * A node that vanishes between create, read and delete (the old session expired
      meanwhile) is not an error: create again.

    Each retry is one round; the first comes at once, the next after a doubling delay
    (``backoff_s`` up to ``max_backoff_s``); after ``attempts`` rounds: **gave up**.
    """

    url: str
    token: str
    _: KW_ONLY
    take_over: TakeOver = TakeOver.ANCHORED
    attempts: int = 8
    backoff_s: float = 0.05
    max_backoff_s: float = 1.0
    step: ClaimStep = field(default=ClaimStep.CREATE, init=False)
    rounds: int = field(default=0, init=False)  #: retries so far
    #: the version to delete (DELETE)
    version: int | None = field(default=None, init=False)
    #: the session whose marker must exist (DELETE)
    anchor: str | None = field(default=None, init=False)
    delay: float = field(default=0.0, init=False)  #: how long to wait (WAIT)
    owner: str | None = field(default=None, init=False)  #: the other holder (REFUSED)
    #: HELD through a node this session had already created
    adopted: bool = field(default=False, init=False)
    #: nodes of earlier runs/sessions deleted
    stale_deleted: int = field(default=0, init=False)
    #: a node of an earlier run or session was seen and left to expire
    waiting_for_expiry: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.attempts = max(1, self.attempts)

    @property
    def done(self) -> bool:
        return self.step in (ClaimStep.HELD, ClaimStep.REFUSED, ClaimStep.GAVE_UP)

    def _expect(self, step: ClaimStep) -> None:
        if self.step is not step:
            raise RuntimeError(f"claim is at {self.step.value}, not {step.value}")

    def created(self) -> None:
        self._expect(ClaimStep.CREATE)
        self.step = ClaimStep.HELD

    def exists(self) -> None:
        """The create failed with ``NodeExists``."""
        self._expect(ClaimStep.CREATE)
        self.step = ClaimStep.READ

    def read(self, value: bytes | None, version: int = -1) -> None:
        self._expect(ClaimStep.READ)
        if value is None:
            self._again()  # gone since the create failed: its session expired
            return
        try:
            doc = json.loads(value)
        except ValueError:
            doc = None
        holder = doc if isinstance(doc, dict) else {}
        if holder.get("token") == self.token and holder.get("url") == self.url:
            self.step, self.adopted = ClaimStep.HELD, True
        elif holder.get("url") == self.url:
            token = holder.get("token")
            if self.take_over is TakeOver.ALWAYS:
                self.step, self.version, self.anchor = ClaimStep.DELETE, version, None
            elif self.take_over is TakeOver.ANCHORED and isinstance(token, str) and token:
                self.step, self.version, self.anchor = ClaimStep.DELETE, version, token
            else:
                self.waiting_for_expiry = True
                self._again()
        else:
            self.step, self.owner = ClaimStep.REFUSED, str(holder.get("url", "unknown"))

    def deleted(self, *, missing: bool = False, changed: bool = False) -> None:
        """The delete succeeded, or found no node or no marker (``missing``: the session
        that owned it expired first), or another version (``changed``)."""
        self._expect(ClaimStep.DELETE)
        if missing:
            self.waiting_for_expiry = True  # gone, or going with its session
        elif not changed:
            self.stale_deleted += 1
        self._again()

    def waited(self) -> None:
        self._expect(ClaimStep.WAIT)
        self.step = ClaimStep.CREATE

    def _again(self) -> None:
        self.rounds += 1
        self.version = self.anchor = None
        if self.rounds >= self.attempts:
            self.step = ClaimStep.GAVE_UP
        elif self.rounds == 1:
            self.step = ClaimStep.CREATE
        else:
            self.step = ClaimStep.WAIT
            self.delay = min(self.max_backoff_s, self.backoff_s * 2 ** (self.rounds - 2))


# ---------------------------------------------------------------------- ownership


class Ownership:
    def __init__(
        self,
        store: Any,
        service_url: str,
        address: str,
        *,
        bundles_per_namespace: int = 4,
        load: Callable[[], dict[str, Any]] = dict,
        report_interval: float = 5.0,
        advertised: dict[str, str] | None = None,
        service_url_tls: str | None = None,
    ) -> None:
        self.store = store
        self.service_url = service_url
        #: ``pigeon+ssl://host:port`` of the broker's TLS listener (None: none), carried
        #: as ``url_tls`` in the registration and every bundle node
        self.service_url_tls = service_url_tls
        self.address = address
        self.bundles = max(1, bundles_per_namespace)
        self.load = load
        #: other front doors' addresses (``{"kafka": "host:port"}``), carried in the
        #: registration and every bundle node so that any broker can route to them
        self.advertised = dict(advertised or {})
        self.report_interval = report_interval
        self.owned: set[str] = set()
        # bundles being unloaded: no topic of theirs may be opened here meanwhile (a
        # client re-attaching at once would find this broker still holding the node)
        self.releasing: set[str] = set()
        #: trio time each owned bundle was acquired (reported as ``held_s``)
        self.acquired_at: dict[str, float] = {}
        #: names every node this broker creates in the current metadata session
        self.token = secrets.token_hex(8)
        #: extra sections of the load report, ``name -> () -> JSON value`` (the load
        #: manager adds its per-bundle loads)
        self.report_sections: dict[str, Callable[[], Any]] = {}
        #: claims settled by taking over a node of an earlier run or session (tests,
        #: logs)
        self.takeovers = 0

    # ------------------------------------------------------------------ bundles

    def bundle_of(self, name: TopicName) -> str:
        """``0xSTART_0xEND`` of the bundle holding ``name`` (partitions stay together)."""
        base = name.base.full
        h = zlib.crc32(base.encode())
        size = FULL_RANGE // self.bundles
        index = min(h // size, self.bundles - 1)
        start = index * size
        end = FULL_RANGE if index == self.bundles - 1 else start + size
        return f"0x{start:08x}_0x{end:08x}"

    def path_of(self, name: TopicName) -> str:
        return f"{OWNERSHIP_PATH}/{name.tenant}/{name.namespace}/{self.bundle_of(name)}"

    def owns(self, name: TopicName) -> bool:
        return self.path_of(name) in self.owned

    async def owner_of(self, name: TopicName) -> str | None:
        owner = await self.owner_record(name)
        return None if owner is None else str(owner["url"])

    async def owner_record(self, name: TopicName) -> dict[str, Any] | None:
        """The bundle node's value (url, address, token, advertised front doors)."""
        stat = await self.store.get(self.path_of(name))
        if stat is None:
            return None
        value: dict[str, Any] = json.loads(stat.value)
        return value

    def _value(self, **fields: Any) -> bytes:
        return json.dumps(
            {
                "url": self.service_url,
                "address": self.address,
                "token": self.token,
                **({"url_tls": self.service_url_tls} if self.service_url_tls else {}),
                **self.advertised,
                **fields,
            }
        ).encode()

    async def _hold(self, path: str, value: Callable[[], bytes], *, take_over: TakeOver) -> Claim:
        """Drive a :class:`Claim` of the ephemeral node ``path`` to its end.

        ``SessionExpired`` and other metadata errors propagate."""
        claim = Claim(self.service_url, self.token, take_over=take_over)
        while not claim.done:
            step = claim.step
            if step is ClaimStep.CREATE:
                try:
                    await self.store.create(path, value(), ephemeral=True)
                except NodeExists:
                    claim.exists()
                else:
                    claim.created()
            elif step is ClaimStep.READ:
                stat = await self.store.get(path)
                claim.read(
                    None if stat is None else stat.value, -1 if stat is None else stat.version
                )
            elif step is ClaimStep.DELETE:
                try:
                    if claim.anchor is None:
                        await self.store.delete(path, version=claim.version)
                    else:  # atomically: only while the earlier session is alive
                        await self.store.multi(
                            [
                                Op.check(f"{BROKER_SESSIONS_PATH}/{claim.anchor}"),
                                Op.delete(path, version=claim.version),
                            ]
                        )
                except NoSuchNode:
                    claim.deleted(missing=True)
                except BadVersion:
                    claim.deleted(changed=True)
                else:
                    log.info("took over a node of an earlier run path=%s", path)
                    claim.deleted()
            else:
                await trio.sleep(claim.delay)
                claim.waited()
        if claim.stale_deleted:
            self.takeovers += 1
        return claim

    async def acquire(self, name: TopicName) -> None:
        """Claim the topic's bundle for this broker; NotOwner if another holds it."""
        path = self.path_of(name)
        if path in self.releasing:
            raise NotOwner(f"the bundle of {name} is being unloaded here; look it up again")
        if path in self.owned:
            await trio.lowlevel.checkpoint()
            return
        token = self.token
        try:
            claim = await self._hold(path, self._value, take_over=TakeOver.ANCHORED)
        except SessionExpired:
            # being renewed by run(): the client looks the topic up again
            raise NotOwner(f"metadata session lost; try {name} again") from None
        if claim.step is ClaimStep.REFUSED:
            raise NotOwner(f"{name} is served by {claim.owner}")
        if claim.step is ClaimStep.GAVE_UP and claim.waiting_for_expiry:
            raise NotOwner(
                f"the bundle of {name} is still held by an earlier run of this broker"
                " until its metadata session expires; try again"
            )
        if claim.step is not ClaimStep.HELD or token != self.token:
            # gave up, or the session was lost meanwhile (the node went with it)
            raise NotOwner(f"could not acquire the bundle of {name}; try again")
        if path not in self.owned:
            self.owned.add(path)
            self.acquired_at[path] = trio.current_time()
            log.info("bundle acquired bundle=%s rounds=%d", path, claim.rounds)

    @contextlib.asynccontextmanager
    async def release(self, path: str) -> AsyncIterator[None]:
        """Give the bundle ``path`` up: while the body runs (closing its topics here) none
        of its topics may be acquired here; afterwards, if it was owned, it is not any
        more and its node is deleted (the least-loaded broker takes it on a lookup)."""
        self.releasing.add(path)
        try:
            yield
            if path in self.owned:
                self.owned.discard(path)
                with contextlib.suppress(NoSuchNode):
                    await self.store.delete(path)
        finally:
            self.releasing.discard(path)

    def held_for(self, path: str) -> float:
        """Seconds since this broker acquired the owned bundle ``path``."""
        return max(0.0, trio.current_time() - self.acquired_at.get(path, trio.current_time()))

    # ------------------------------------------------------------------ lookups

    async def brokers(self) -> dict[str, dict[str, Any]]:
        found: dict[str, dict[str, Any]] = {}
        for child in await self.store.children(BROKERS_PATH):
            stat = await self.store.get(f"{BROKERS_PATH}/{child}")
            if stat is not None:
                try:
                    found[child] = json.loads(stat.value)
                except ValueError:
                    continue
        return found

    async def lookup(self, name: TopicName, *, tls: bool = False) -> str:
        """The owner's service URL, or the least-loaded broker's for an unowned bundle;
        with ``tls`` its ``pigeon+ssl://`` URL (:class:`TlsError` if it has no TLS
        listener)."""
        record = await self.lookup_record(name)
        url = str(record.get("url", self.service_url))
        if not tls:
            return url
        url_tls = record.get("url_tls")
        if not url_tls:
            raise TlsError(
                f"{name} is served by {url}, which has no TLS listener"
                " (broker_service_port_tls); connect with pigeon:// or enable TLS there"
            )
        return str(url_tls)

    async def lookup_record(self, name: TopicName) -> dict[str, Any]:
        """The owner's record (see :meth:`owner_record`), or the least-loaded broker's
        registration for an unowned bundle (this broker's own record if none is)."""
        owner = await self.owner_record(name)
        if owner is not None:
            return owner
        brokers = await self.brokers()
        if not brokers:
            return json.loads(self._value())  # type: ignore[no-any-return]
        return min(brokers.values(), key=lambda b: (b.get("topics", 0), b.get("url", "")))

    # ------------------------------------------------------------------ lifecycle

    def _report(self) -> bytes:
        sections = {}
        for key, section in self.report_sections.items():
            try:
                sections[key] = section()
            except Exception as exc:  # a report is best effort: never lose the rest
                log.warning("load report section failed section=%s error=%r", key, exc)
        return self._value(**self.load(), **sections)

    async def register(self) -> None:
        """Publish this broker at ``/pigeon/brokers/available/<address>``.

        A node left there by an earlier run (its session not yet expired) is replaced;
        one that expires meanwhile is no error.  ``MetadataError`` if the address is
        registered by another broker, or the node keeps changing."""
        path = f"{BROKERS_PATH}/{self.address}"
        claim = await self._hold(path, self._report, take_over=TakeOver.ALWAYS)
        if claim.step is ClaimStep.REFUSED:
            raise AddressTaken(f"{path} is registered by another broker ({claim.owner})")
        if claim.step is not ClaimStep.HELD:
            raise MetadataError(f"could not register {path} in {claim.rounds} rounds")
        marker = f"{BROKER_SESSIONS_PATH}/{self.token}"
        try:  # lets a later run of this broker take over this session's bundles
            await self.store.create(marker, self.service_url.encode(), ephemeral=True)
        except NodeExists:
            pass  # registered again within the same session
        log.info(
            "broker registered path=%s rounds=%d replaced=%d",
            path,
            claim.rounds,
            claim.stale_deleted,
        )

    async def _register_at_start(self) -> None:
        """Register, waiting out a metadata server that drops the connection or the
        session meanwhile (a broker restarted during a ZooKeeper hiccup exited, and its
        layer ran one broker short).  A broker address registered by another broker is
        no such hiccup: it raises."""
        delay = REGISTER_RETRY_S[0]
        while True:
            try:
                await self.register()
                return
            except SessionExpired as exc:
                log.warning("registering failed, new metadata session error=%s", exc)
                self.token = secrets.token_hex(8)
                with contextlib.suppress(PigeonError):
                    await self.store.new_session()
            except PigeonError as exc:
                if not exc.retriable:
                    raise
                log.warning("registering failed, retrying in %.1fs error=%s", delay, exc)
            await trio.sleep(delay)
            delay = min(delay * 2, REGISTER_RETRY_S[1])

    async def run(
        self,
        on_lost: Callable[[], Any],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Register, refresh the load report, and handle a lost metadata session."""
        await self._register_at_start()
        task_status.started()
        async with trio.open_nursery() as nursery:

            async def refresh() -> None:
                while True:
                    await trio.sleep(self.report_interval)
                    try:
                        await self.store.set(f"{BROKERS_PATH}/{self.address}", self._report())
                    except NoSuchNode:
                        log.warning("broker registration gone: registering again")
                        try:
                            await self.register()
                        except PigeonError as exc:
                            log.warning("registering again failed error=%s", exc)
                    except PigeonError as exc:
                        log.info("load report failed error=%s", exc)

            nursery.start_soon(refresh)
            while True:
                await self.store.wait_session_expired()
                log.warning("metadata session expired: giving up every owned bundle")
                self.token = secrets.token_hex(8)  # nodes of the old session are not ours
                self.owned.clear()
                self.acquired_at.clear()
                await on_lost()
                while True:
                    try:
                        await self.store.new_session()
                        await self.register()
                        break
                    except PigeonError as exc:
                        log.warning("re-registering failed error=%s", exc)
                        await trio.sleep(1.0)
