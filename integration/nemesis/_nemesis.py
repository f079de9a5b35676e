"""The nemesis: a seeded fault schedule, and a thread that carries it out.

:func:`plan` is pure: the same seed, duration and targets give the same schedule, so a
failing run replays (``PIGEON_NEMESIS_SEED``).  Faults never overlap: one fault at a
time, each healed before the next begins, so at most one node of any layer is down and
redundancy always remains.  Kinds:

* ``kill``: SIGKILL, then start the node again (same port, same data) when healed;
* ``pause``: SIGSTOP, SIGCONT when healed;
* ``cut``: black-hole every link of the node (its proxy and its metadata link).

The metadata server (ZooKeeper, etcd) is killed or paused, never cut, and only briefly.

:class:`Nemesis` also acts as the nodes' supervisor: a node that exits by itself (not
killed by the nemesis) is recorded as a ``crash`` event, with its exit code and log tail,
and started again, as systemd's ``Restart=always`` would.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

from ._history import Fault, History
from ._topology import Topology

__all__ = ["Nemesis", "Planned", "format_schedule", "plan"]

#: seconds between the starts of two faults
GAP = (4.0, 8.0)
#: how long a bookie or broker fault lasts
HOLD = (2.0, 4.0)
#: how long the metadata server is down or paused
METADATA_HOLD = (1.0, 2.0)
NODE_KINDS = ("kill", "pause", "cut")
METADATA_KINDS = ("kill", "pause")
#: a node that does not come back is tried again this many times, a second apart
RESTART_TRIES = 5
_TICK = 0.25


@dataclass(frozen=True)
class Planned:
    at: float  # seconds after the nemesis started
    kind: str
    target: str
    duration: float


def plan(
    seed: int,
    duration: float,
    *,
    bookies: list[str],
    brokers: list[str],
    metadata_server: bool,
) -> list[Planned]:
    """The faults of a run: every 4-8 s one, healed 2-4 s later (metadata: 1-2 s); the
    last one is healed before ``duration`` ends."""
    rng = random.Random(seed)
    layers = [("bookie", 2.0), ("broker", 2.0)] + ([("metadata", 1.0)] if metadata_server else [])
    out: list[Planned] = []
    at = rng.uniform(*GAP)
    while True:
        layer = rng.choices([name for name, _ in layers], [w for _, w in layers])[0]
        if layer == "metadata":
            kind, target = rng.choice(METADATA_KINDS), "metadata"
            hold = rng.uniform(*METADATA_HOLD)
        else:
            kind = rng.choice(NODE_KINDS)
            target = rng.choice(bookies if layer == "bookie" else brokers)
            hold = rng.uniform(*HOLD)
        if at + hold >= duration:
            return out
        out.append(Planned(round(at, 2), kind, target, round(hold, 2)))
        at += rng.uniform(*GAP)


def format_schedule(schedule: list[Planned]) -> str:
    return "\n".join(
        f"  {p.at:7.2f}s {p.kind:<5} {p.target:<9} for {p.duration:.2f}s" for p in schedule
    )


class Nemesis:
    """Carries out a schedule on a :class:`Topology`, recording into a History."""

    def __init__(self, topology: Topology, history: History, schedule: list[Planned]) -> None:
        self.topology = topology
        self.history = history
        self.schedule = schedule
        self.stop = threading.Event()
        self._down: set[str] = set()  # killed by us, not to be restarted by the supervisor
        self._dead: set[str] = set()  # down by themselves (or not restarted), recorded
        self._thread = threading.Thread(target=self._run, name="nemesis", daemon=True)
        self._error: BaseException | None = None

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._thread.start()

    def finish(self, timeout: float = 90.0) -> None:
        """Stop injecting, heal the fault in progress, and return once the thread ended
        (a start in progress is bounded by the servers' ready timeouts)."""
        self.stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError(f"nemesis thread did not stop within {timeout}s")
        if self._error is not None:
            raise self._error

    def join(self, timeout: float = 150.0) -> None:
        """Stop and wait for the thread, without raising (teardown)."""
        self.stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def heal_everything(self, deadline: float) -> None:
        """SIGCONT and unblock everything; start every node that is not running."""
        self.topology.heal_all()
        self._down.clear()
        self._dead.clear()
        names = [*(["metadata"] if self.topology.server else []), *self.topology.nodes]
        for name in names:
            while not self.topology.running(name) and time.monotonic() < deadline:
                self._restart(name, final=True)
        self.history.healed_at = self.history.now()

    # ------------------------------------------------------------------ thread

    def _run(self) -> None:
        try:
            for p in self.schedule:
                if not self._idle_until(self._t0 + p.at):
                    return
                self._carry_out(p)
        except BaseException as exc:  # reported by finish()
            self._error = exc

    def _idle_until(self, when: float) -> bool:
        """Supervise until ``when``; False if asked to stop first."""
        while True:
            self._supervise()
            left = when - time.monotonic()
            if left <= 0:
                return True
            if self.stop.wait(min(left, _TICK)):
                return False

    def _carry_out(self, p: Planned) -> None:
        fault = Fault(p.kind, p.target, p.at, p.duration, started=self.history.now())
        self.history.faults.append(fault)
        topo = self.topology
        if p.kind == "kill":
            self._down.add(p.target)
            topo.kill(p.target)
        elif p.kind == "pause":
            topo.pause(p.target)
        else:
            topo.cut(p.target)
        end = time.monotonic() + p.duration
        while not self.stop.is_set() and time.monotonic() < end:
            self.stop.wait(min(_TICK, max(0.0, end - time.monotonic())))
            self._supervise(restart=False)  # never hold a fault open with a restart
        if p.kind == "kill":
            self._down.discard(p.target)
            if not self._restart(p.target):
                fault.note = "did not come back"
                self._dead.add(p.target)  # the supervisor tries again later
        elif p.kind == "pause":
            topo.resume(p.target)
        else:
            topo.heal(p.target)
        fault.healed = self.history.now()

    def _restart(self, name: str, *, final: bool = False) -> bool:
        """Start ``name`` again, a few tries; the nemesis thread gives up early when asked
        to stop (the final :meth:`heal_everything` takes over)."""
        for attempt in range(RESTART_TRIES):
            try:
                self.topology.start_node(name)
                return True
            except Exception as exc:
                text = " | ".join(str(exc).splitlines())
                self.history.event(
                    "restart-failed",
                    f"{name} attempt={attempt + 1} error={text[:150]}...{text[-300:]}",
                )
                if self.stop.is_set() and not final:
                    return False
                time.sleep(1.0)
        return False

    def _supervise(self, *, restart: bool = True) -> None:
        """Record nodes that exited by themselves (once each) and, between faults, start
        them again."""
        for name in [*(["metadata"] if self.topology.server else []), *self.topology.nodes]:
            if name in self._down or self.topology.running(name):
                continue
            if name not in self._dead:
                self._dead.add(name)
                code = self.topology.exit_code(name)
                tail = " | ".join(self.topology.log_tail(name, 6).splitlines())
                self.history.event("crash", f"{name} exit={code} log: {tail[-600:]}")
            if restart and self._restart(name):
                self._dead.discard(name)
