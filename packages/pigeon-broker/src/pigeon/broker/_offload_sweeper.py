"""The offload sweeper: deletes offloaded objects no ledger refers to.

The broker avoids orphan objects at their cause (``offload_pending`` saved before an
upload, ``offload_deleting`` saved with a segment's removal, the uploader deleting what
it wrote when its segment went meanwhile: see ``_ledger_offload``).  What a crash still
leaves — a topic deleted while an upload ran on a broker that then died, a topic
deletion cut short between its ledger node and the keys of its uploads, objects of a
``filesystem`` upload killed half-way (temporary files) — is found here.

One broker sweeps (elected at ``/pigeon/offload-sweeper``), every
``managed_ledger_offload_sweep_interval_s``.  A pass lists at most
``managed_ledger_offload_sweep_max_objects`` objects of the store, from where the last
pass stopped (in path order; at the end it starts over), groups them by segment key
(``<domain>/<tenant>/<namespace>/<topic>/<segment id>``), and reads the ledger of each
topic met **after** listing.  A key is deleted (all its objects, the index first) only
when

* the ledger does not refer to it: no segment records it as its location
  (``offload``) or as an upload under way (``offload_pending``); a deleted topic's
  ledger refers to nothing.  A key in ``offload_deleting`` (a removed segment's, which
  the topic's owner deletes on its next maintenance pass) counts as unreferenced: a
  topic nobody loads again has no owner to do it, and both deletes are idempotent;
* and its newest object is older than ``managed_ledger_offload_orphan_grace_s``.

Only what this cluster's brokers write is looked at: paths
``persistent/<tenant>/<namespace>/<topic>/<segment id>/{data,index}`` (and the
temporary files of the ``filesystem`` driver) of a namespace this cluster has; anything
else in the bucket or directory is left alone.  (A bucket still belongs to one cluster:
two clusters with the same namespace in one bucket would share keys anyway.)

Why that never deletes an object a segment refers to: an upload saves its key
(``offload_pending``) before it writes any object, and a location replaces that key in
the same write, so any object the listing returned was referred to by the ledger's
metadata before the sweeper read it, unless its segment was removed (and then nothing
will ever refer to it: segment ids are never reused).  The grace period covers a
metadata read that lags behind (a ZooKeeper follower) and clocks that disagree.  A
ledger that cannot be read or parsed is skipped, never taken as empty.  Each object
deleted is logged once (INFO); a failed delete is logged once per object (WARNING) and
retried by the next passes.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import trio

from pigeon.broker._ledger_state import SegmentInfo
from pigeon.core.errors import PigeonError
from pigeon.core.metadata import lead_forever
from pigeon.core.offload import StoredObject
from pigeon.core.paths import LEDGERS_PATH, OFFLOAD_SWEEPER_PATH

__all__ = ["OffloadSweeper", "SweeperStatistics"]

log = logging.getLogger(__name__)

#: failed deletes remembered (each logged once)
_WARNED_MAX = 10_000


def _segment_key(path: str) -> str | None:
    """The segment key of an object the broker writes (``persistent/<tenant>/
    <namespace>/<topic>/<segment id>/`` then ``data``, ``index`` or a ``filesystem``
    temporary file of one), else None: anything else in the store is never touched."""
    key, _, name = path.rpartition("/")
    parts = key.split("/")
    if len(parts) != 5 or parts[0] != "persistent" or not parts[4].isdigit():
        return None
    if name not in ("data", "index") and not name.startswith(("data.tmp-", "index.tmp-")):
        return None
    return key


@dataclass(frozen=True, slots=True)
class SweeperStatistics:
    passes: int
    objects_listed: int
    orphans_deleted: int
    delete_failures: int


class OffloadSweeper:
    """Deletes orphaned offloaded objects (see module doc)."""

    def __init__(
        self,
        service: Any,
        *,
        interval_s: float = 3600.0,
        grace_s: float = 6 * 3600.0,
        max_objects: int = 1000,
    ) -> None:
        self.service = service
        self.interval_s = interval_s
        self.grace_s = grace_s
        self.max_objects = max_objects
        #: the last path the previous pass listed ("" : from the start)
        self.after = ""
        self.is_leader = False
        self._passes = self._listed = self._deleted = self._failures = 0
        self._warned: OrderedDict[str, None] = OrderedDict()

    def statistics(self) -> SweeperStatistics:
        return SweeperStatistics(self._passes, self._listed, self._deleted, self._failures)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if self.interval_s <= 0 or not callable(
            getattr(self.service.offloader, "list_objects", None)
        ):
            task_status.started()  # off, or an offloader that cannot list
            return
        await lead_forever(
            self.service.store,
            OFFLOAD_SWEEPER_PATH,
            self.service.service_url,
            self._lead,
            task_status=task_status,
        )

    async def _lead(self) -> None:
        self.is_leader = True
        try:
            while True:
                await trio.sleep(self.interval_s)
                try:
                    await self.sweep_once()
                except PigeonError as exc:
                    log.warning("offload sweep failed error=%s; retried next pass", exc)
        finally:
            self.is_leader = False

    async def sweep_once(self) -> list[str]:
        """One pass (see module doc); returns the paths deleted."""
        offloader = self.service.offloader
        listed: list[StoredObject] = await offloader.list_objects(
            "", after=self.after, limit=self.max_objects
        )
        self._passes += 1
        self._listed += len(listed)
        # the next pass goes on after this page; a short page ends the walk
        self.after = listed[-1].path if len(listed) >= self.max_objects else ""
        keys: dict[str, list[StoredObject]] = {}
        for obj in listed:
            if _segment_key(obj.path) is not None:
                keys.setdefault(obj.path.rpartition("/")[0], []).append(obj)
        # the ledgers are read after the listing (see module doc for why)
        referenced: dict[str, set[str] | None] = {}
        namespaces: dict[str, bool] = {}
        for key in keys:
            topic = key.rpartition("/")[0]
            if topic in referenced:
                continue
            namespace = "/".join(topic.split("/")[1:3])
            if namespace not in namespaces:
                namespaces[namespace] = await self._namespace_exists(namespace)
            # a namespace this cluster does not have: not ours (another cluster's)
            referenced[topic] = await self._referenced(topic) if namespaces[namespace] else None
        now_ms = self.service.clock.now_ms()
        deleted: list[str] = []
        for key, objects in keys.items():
            refs = referenced[key.rpartition("/")[0]]
            if refs is None or key in refs:
                continue
            age_s = (now_ms - max(o.modified_ms for o in objects)) / 1000
            if age_s < self.grace_s:
                continue
            paths = [o.path for o in objects]
            try:
                await offloader.delete_objects(paths)
            except PigeonError as exc:
                self._failures += 1
                for path in paths:
                    if path not in self._warned:
                        self._warned[path] = None
                        log.warning(
                            "orphaned offloaded object not deleted path=%s error=%s;"
                            " retried next pass",
                            path,
                            exc,
                        )
                while len(self._warned) > _WARNED_MAX:
                    self._warned.popitem(last=False)
                continue
            for path in paths:
                self._warned.pop(path, None)
                log.info(
                    "orphaned offloaded object deleted path=%s age_s=%.0f (no ledger refers to it)",
                    path,
                    age_s,
                )
            self._deleted += len(paths)
            deleted.extend(paths)
        return deleted

    async def _namespace_exists(self, namespace: str) -> bool:
        try:
            return bool(await self.service.policies.exists(namespace))
        except PigeonError as exc:
            log.warning("offload sweep skips namespace=%s: %s", namespace, exc)
            return False

    async def _referenced(self, topic_path: str) -> set[str] | None:
        """The offload keys the ledger of ``topic_path`` refers to (empty: no ledger);
        None when it cannot be told (the sweep then keeps the topic's objects)."""
        try:
            stat = await self.service.store.get(f"{LEDGERS_PATH}/{topic_path}")
            if stat is None:
                return set()
            doc = json.loads(stat.value)
            refs: set[str] = set()
            for seg_doc in doc.get("segments", []):
                for location in SegmentInfo.from_doc(seg_doc).offloaded_objects():
                    refs.add(str(location.get("key")))
            return refs
        except (PigeonError, ValueError, TypeError, AttributeError) as exc:
            log.warning(
                "offload sweep skips topic=%s: cannot read its ledger (%s)", topic_path, exc
            )
            return None
