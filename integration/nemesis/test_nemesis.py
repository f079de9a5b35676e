"""The nemesis matrix: a cluster under faults must keep every promise of DESIGN §13.

A cell is metadata x replication x ledger storage.  CI (``nox -s tests``) runs five cells
for 60 s each: ZooKeeper + quorum and embedded + quorum on ``segment-files`` bookies,
etcd + leader-follower and embedded + quorum on ``journal`` bookies, and one cell with
TLS + tokens + authorization on every link (``embedded-leader-follower-secure``:
leader-follower, so that the bookies' forwarding to each other is secured too; see
``_topology.py``).  ``nox -s nemesis`` runs every metadata x replication x storage cell
for 10 minutes, ``nox -s nemesis_secure`` the secure cell.  Knobs (environment):

* ``PIGEON_NEMESIS_SEED``: the fault schedule's seed (default: a new one, printed);
* ``PIGEON_NEMESIS_DURATION``: seconds of faults and production (default 60);
* ``PIGEON_NEMESIS_MATRIX=full``: every cell, not only CI's (the secure cell runs
  either way);
* ``PIGEON_NEMESIS_RESULTS``: the JSON file each run appends its figures to
  (default ``nemesis-results.json`` in pytest's base temporary directory).

A failing run prints its seed, schedule, events and violations: the same seed replays
the same schedule.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest

from ._run import append_result, run_nemesis

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: (metadata, replication, ledger storage) of the CI cells: both storages are covered
CI_CELLS = [
    ("zookeeper", "quorum", "segment-files"),
    ("etcd", "leader-follower", "journal"),
    ("embedded", "quorum", "segment-files"),
    ("embedded", "quorum", "journal"),
]
STORAGES = ("segment-files", "journal")
ALL_CELLS = [
    (m, r, s)
    for m in ("embedded", "zookeeper", "etcd")
    for r in ("quorum", "leader-follower")
    for s in STORAGES
]
#: the cells run with TLS + tokens + authorization on every link
SECURE_CELLS = [("embedded", "leader-follower", "segment-files")]
PLAIN = ALL_CELLS if os.environ.get("PIGEON_NEMESIS_MATRIX") == "full" else CI_CELLS
CELLS = [(m, r, s, False) for m, r, s in PLAIN] + [(m, r, s, True) for m, r, s in SECURE_CELLS]


#: under CI (``CI=true``) each cell replays one known schedule, so that a red run is a
#: regression that replays here, not a new schedule's luck; elsewhere a new seed each run
CI_SEEDS = {
    ("zookeeper", "quorum", "segment-files", False): 4242,
    ("etcd", "leader-follower", "journal", False): 777,
    ("embedded", "quorum", "segment-files", False): 777,
    ("embedded", "quorum", "journal", False): 777,
    ("embedded", "leader-follower", "segment-files", True): 1515,
}


def _seed(metadata: str, replication: str, storage: str, secure: bool) -> int:
    value = os.environ.get("PIGEON_NEMESIS_SEED")
    if value:
        return int(value)
    if os.environ.get("CI") and (metadata, replication, storage, secure) in CI_SEEDS:
        return CI_SEEDS[(metadata, replication, storage, secure)]
    return random.SystemRandom().randrange(1, 1_000_000)


def _cell_id(metadata: str, replication: str, storage: str, secure: bool) -> str:
    """``embedded-quorum`` (segment-files), ``embedded-quorum-journal``, ``...-secure``."""
    journal = "-journal" if storage == "journal" else ""
    return f"{metadata}-{replication}{journal}{'-secure' if secure else ''}"


def _duration() -> float:
    return float(os.environ.get("PIGEON_NEMESIS_DURATION", "60"))


def _results_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = os.environ.get("PIGEON_NEMESIS_RESULTS")
    return Path(path) if path else tmp_path_factory.getbasetemp() / "nemesis-results.json"


@pytest.mark.parametrize(
    ("metadata", "replication", "storage", "secure"),
    CELLS,
    ids=[_cell_id(*cell) for cell in CELLS],
)
def test_no_acknowledged_message_is_lost_under_the_nemesis(
    metadata: str,
    replication: str,
    storage: str,
    secure: bool,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    result = run_nemesis(
        tmp_path / "run",
        metadata,
        replication,
        seed=_seed(metadata, replication, storage, secure),
        duration=_duration(),
        secure=secure,
        storage=storage,
    )
    results = _results_file(tmp_path_factory)
    append_result(results, result.figures())
    print(f"\n{result.summary()}\nfigures appended to {results}")
    if result.report.violations:
        # pytest keeps only its last three temp dirs: the logs of a failed run are copied
        # where a later run does not delete them
        kept = Path(tempfile.gettempdir()) / (
            f"pigeon-nemesis-failed-{_cell_id(metadata, replication, storage, secure)}"
            f"-{result.seed}-{os.getpid()}"
        )
        shutil.copytree(tmp_path / "run", kept, dirs_exist_ok=True)
        pytest.fail(f"{result.explain()}\nthe run's logs are kept in {kept}")
