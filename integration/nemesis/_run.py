"""One nemesis run from start to verdict: cluster, workload, faults, recovery, check.

    result = run_nemesis(tmp_path, "zookeeper", "quorum", seed=7, duration=60)
    result = run_nemesis(tmp_path, "embedded", "quorum", seed=7, duration=60, secure=True)
    result.report.violations   # empty when every promise held

Phases (every wait bounded): start the cluster behind proxies; open the workload; run
the seeded fault schedule while producing for ``duration`` seconds; heal everything
(SIGCONT, unblock, restart what is down) and stop producing; wait for every send to
resolve; drain every consumer and reader; read every topic from the earliest position
with a fresh subscription; check the history.  The run's directory keeps the node logs,
``history.jsonl.gz`` and ``report.json``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pigeon.core.testing.servers import SecurityFiles

from ._checker import Report, check
from ._history import History
from ._kafka_workload import KafkaWorkload
from ._nemesis import Nemesis, Planned, format_schedule, plan
from ._proxy import ProxyHub
from ._topology import Topology, routed_lookups
from ._workload import Workload

__all__ = ["RunResult", "append_result", "run_nemesis"]

#: longest wait for the cluster to come back after the last fault
RECOVERY_TIMEOUT = 60.0
#: longest the consumers and readers get to catch up after production stopped
DRAIN_TIMEOUT = 30.0
#: per topic
FINAL_READ_TIMEOUT = 30.0
#: after the last fault was healed, how long the Kafka producer's sends get to resolve
SETTLE_TIMEOUT = 30.0


@dataclass
class RunResult:
    metadata: str
    replication: str
    seed: int
    duration: float
    schedule: list[Planned]
    report: Report
    history: History
    directory: Path
    phases: dict[str, float] = field(default_factory=dict)
    proxies: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: TLS + tokens + authorization on every link (``Topology(security=...)``)
    secure: bool = False
    #: the bookies' ledger storage (``segment-files`` or ``journal``)
    storage: str = "segment-files"

    def figures(self) -> dict[str, Any]:
        return {
            "metadata": self.metadata,
            "replication": self.replication,
            "storage": self.storage,
            "secure": self.secure,
            "seed": self.seed,
            "duration_s": self.duration,
            **self.report.figures(),
            "phases_s": {k: round(v, 1) for k, v in self.phases.items()},
            "commit": _commit(),
            "code": str(_code()),
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }

    def summary(self) -> str:
        secure = "+secure" if self.secure else ""
        return (
            f"nemesis {self.metadata}+{self.replication}+{self.storage}{secure} seed={self.seed} "
            f"duration={self.duration:.0f}s {self.report.summary()}"
        )

    def explain(self) -> str:
        """Everything needed to understand and replay a failure."""
        r = self.report
        lines = [
            self.summary(),
            f"replay: PIGEON_NEMESIS_SEED={self.seed} PIGEON_NEMESIS_DURATION={self.duration:.0f}",
            "schedule:",
            format_schedule(self.schedule),
            "faults as carried out:",
            *(
                f"  {f.kind} {f.target} {f.started}->{f.healed} {f.note}".rstrip()
                for f in self.history.faults
            ),
            "events:",
            *(f"  {e.t:7.2f}s {e.kind} {e.detail}" for e in _some(self.history.events)),
            f"undelivered per subscription: {r.undelivered}",
            f"redelivered per subscription: {r.redelivered}",
            f"longest stretch short of consumers (s): {r.detached_longest}",
            f"longest write unavailability by topic: {r.longest_unavailable_by_topic}",
            f"longest write unavailability per fault: {r.unavailable_after_fault}",
            f"proxies: {self.proxies}",
            f"final read: {self.history.final_read_status}",
            f"run directory (logs, history.jsonl.gz): {self.directory}",
            "violations:",
            *(f"  {v}" for v in r.violations),
        ]
        return "\n".join(lines)


def run_nemesis(
    root: Path,
    metadata: str,
    replication: str,
    *,
    seed: int,
    duration: float,
    producers: int = 3,
    rate: float = 200.0,
    secure: bool = False,
    storage: str = "segment-files",
) -> RunResult:
    root.mkdir(parents=True, exist_ok=True)
    history = History()
    phases: dict[str, float] = {}
    mark = time.monotonic()
    failure: BaseException | None = None
    schedule: list[Planned] = []

    def phase(name: str) -> None:
        nonlocal mark
        now = time.monotonic()
        phases[name] = now - mark
        mark = now

    with ProxyHub() as hub, _client_log(root / "client.log"):
        security = SecurityFiles.create(root / "security") if secure else None
        topology = Topology(root, metadata, replication, hub, security=security, storage=storage)
        try:
            topology.start()
            schedule = plan(
                seed,
                duration,
                bookies=topology.bookies,
                brokers=topology.brokers,
                metadata_server=topology.server is not None,
            )
            print(f"nemesis seed={seed} schedule:\n{format_schedule(schedule)}", flush=True)
            phase("start")
            with routed_lookups(topology.routes):
                workload = Workload(topology, history, producers=producers, rate=rate)
                kafka = KafkaWorkload(topology, history, workload.delivered, rate=rate / 2)
                nemesis = Nemesis(topology, history, schedule)
                try:
                    workload.start()
                    kafka.start()
                    nemesis.start()
                    time.sleep(duration)
                    nemesis.finish()
                    nemesis.heal_everything(time.monotonic() + RECOVERY_TIMEOUT)
                    phase("faults")
                    workload.stop_production()
                    kafka.stop_production(SETTLE_TIMEOUT)
                    phase("settle-sends")
                    workload.drain(time.monotonic() + DRAIN_TIMEOUT)
                    phase("drain")
                    workload.final_read(FINAL_READ_TIMEOUT)
                    phase("final-read")
                except Exception as exc:  # reported with the history below
                    failure = exc
                finally:
                    nemesis.join()  # never stop the cluster under a node it is starting
                    kafka.close()
                    workload.close()
        finally:
            topology.heal_all()
            topology.stop()
        proxies = {name: vars(p.statistics()) for name, p in hub.proxies.items()}
    report = check(history)
    result = RunResult(
        metadata,
        replication,
        seed,
        duration,
        schedule,
        report,
        history,
        root,
        phases,
        proxies,
        secure=secure,
        storage=storage,
    )
    history.dump(root / "history.jsonl.gz")
    if failure is not None:
        raise AssertionError(
            f"the nemesis run itself failed ({failure!r}); what it saw so far:\n" + result.explain()
        ) from failure
    (root / "report.json").write_text(json.dumps(result.figures(), indent=2) + "\n")
    return result


@contextlib.contextmanager
def _client_log(path: Path) -> Iterator[None]:
    """The workload's clients log (INFO and up, ``pigeon.*``) into ``path`` for the run."""
    handler = logging.FileHandler(path)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(threadName)s %(name)s %(message)s")
    )
    logger = logging.getLogger("pigeon")
    level = logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        handler.close()


def append_result(path: Path, figures: dict[str, Any]) -> None:
    """Add one run's figures to the JSON list in ``path`` (created if missing)."""
    runs: list[dict[str, Any]] = []
    if path.exists():
        try:
            runs = list(json.loads(path.read_text()))
        except ValueError:
            runs = []
    runs.append(figures)
    path.write_text(json.dumps(runs, indent=2) + "\n")


def _code() -> Path:
    """Where the code under test is imported from (PYTHONPATH may point at a snapshot)."""
    import pigeon.core

    return Path(pigeon.core.__file__).resolve().parents[5]


def _commit() -> str:
    """The code's commit: ``REVISION`` of a snapshot, or ``git describe`` of a checkout."""
    code = _code()
    for folder in (code, *code.parents):
        if (folder / "REVISION").is_file():
            return (folder / "REVISION").read_text().strip()
    try:
        out = subprocess.run(
            ["git", "-C", str(code), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _some(events: list[Any]) -> list[Any]:
    """The first 60 events and the last 60 (a stall shows at the end)."""
    if len(events) <= 120:
        return events
    return [*events[:60], *events[-60:]]
