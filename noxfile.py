"""Every developer task, by what it does.

Sessions run in the environment they are started from (``scripts/bootstrap`` builds
``.venv`` with every package installed editable), so CI pays for one install.

    nox -s tests          unit tests of every package and plugin, then the integration suite
    nox -s unit           unit tests only
    nox -s integration    multi-process tests against real servers
    nox -s cluster        cluster fault tests, one session per metadata x replication x storage
    nox -s nemesis        the nemesis suite, 10 minutes per metadata x replication x storage
    nox -s nemesis_secure the nemesis with TLS + tokens on every link, 10 minutes
    nox -s lint           ruff + mypy
    nox -s wheels         a wheel of every package and plugin into dist/ (scripts/build-wheels)
    nox -s bench          benchmark scenarios, results into docs/benchmarks.md
    nox -s bench_storage  the ledger storages and tiered storage side by side (same file)
"""

from __future__ import annotations

import glob
import os
import tempfile

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

UNIT_PATHS = [*sorted(glob.glob("packages/*/tests")), "plugins"]
METADATA_BACKENDS = ["embedded", "zookeeper", "etcd"]
#: replication policy -> the pytest id of its cluster test parameter
REPLICATION_POLICIES = {"quorum": "quorum", "leader-follower": "lf"}
#: the sources mypy checks in strict mode
TYPED_SOURCES = [
    f"packages/pigeon-{name}/src/pigeon/{name}" for name in ("core", "client", "broker", "spark")
]
SPARK_TESTS = ["integration/test_spark.py", "integration/test_spark_range.py"]
#: the bookies' ledger storage backends (the storage axis of the cluster and nemesis runs)
LEDGER_STORAGES = ["segment-files", "journal"]


@nox.session(venv_backend="none")
def unit(session: nox.Session) -> None:
    """Unit and contract tests of every package and plugin."""
    session.run("python", "-m", "pytest", "-q", *UNIT_PATHS, *session.posargs)


@nox.session(venv_backend="none")
def integration(session: nox.Session) -> None:
    """Real processes and real servers over loopback."""
    session.run("python", "-m", "pytest", "-q", "integration", *session.posargs)


@nox.session(venv_backend="none")
@nox.parametrize("metadata", METADATA_BACKENDS)
@nox.parametrize("replication", list(REPLICATION_POLICIES))
@nox.parametrize("storage", LEDGER_STORAGES)
def cluster(session: nox.Session, metadata: str, replication: str, storage: str) -> None:
    """The cluster fault tests on one metadata backend with one replication policy and
    one ledger storage on the bookies.

    ``nox -s cluster`` runs the whole matrix (metadata x replication x storage), one
    session per cell, every cell of every test (``PIGEON_CLUSTER_MATRIX=full``);
    ``nox -s tests`` runs the same tests in one pytest run (CI, on segment-files), the
    tests marked ``ci_cells`` on three cells each (every backend and policy among them,
    every cell by some test; ``integration/conftest.py`` deselects the rest).  Tests that
    need no metadata server (the auditor's) run in the ``embedded`` sessions.
    """
    others = " or ".join(i for p, i in REPLICATION_POLICIES.items() if p != replication)
    place = "(embedded or not (zookeeper or etcd))" if metadata == "embedded" else metadata
    selector = f"{place} and not ({others})"
    session.run(
        "python",
        "-m",
        "pytest",
        "-q",
        "integration/test_cluster_failover.py",
        "-k",
        selector,
        *session.posargs,
        env={"PIGEON_TEST_LEDGER_STORAGE": storage, "PIGEON_CLUSTER_MATRIX": "full"},
    )


@nox.session(venv_backend="none")
@nox.parametrize("metadata", METADATA_BACKENDS)
@nox.parametrize("replication", list(REPLICATION_POLICIES))
@nox.parametrize("storage", LEDGER_STORAGES)
def nemesis(session: nox.Session, metadata: str, replication: str, storage: str) -> None:
    """Faults, workload and history checker (integration/nemesis) on one metadata x
    replication x ledger storage cell, for ``PIGEON_NEMESIS_DURATION`` seconds (default
    600).

    Each run appends its figures to ``PIGEON_NEMESIS_RESULTS`` (default
    ``$TMPDIR/pigeon-nemesis-results.json``); ``PIGEON_NEMESIS_SEED`` replays a schedule.
    """
    env = {
        "PIGEON_NEMESIS_MATRIX": "full",
        "PIGEON_NEMESIS_DURATION": os.environ.get("PIGEON_NEMESIS_DURATION", "600"),
        "PIGEON_NEMESIS_RESULTS": os.environ.get(
            "PIGEON_NEMESIS_RESULTS",
            os.path.join(tempfile.gettempdir(), "pigeon-nemesis-results.json"),
        ),
    }
    session.run(
        "python",
        "-m",
        "pytest",
        "-q",
        "-s",
        "integration/nemesis/test_nemesis.py",
        "-k",
        f"{metadata}-{replication}-journal and not secure"
        if storage == "journal"
        else f"{metadata}-{replication} and not journal and not secure",
        *session.posargs,
        env=env,
    )


@nox.session(venv_backend="none")
def nemesis_secure(session: nox.Session) -> None:
    """The nemesis with TLS + tokens + authorization on every link (the secure pair of
    ``integration/nemesis/test_nemesis.py``), ``PIGEON_NEMESIS_DURATION`` seconds
    (default 600)."""
    env = {
        "PIGEON_NEMESIS_DURATION": os.environ.get("PIGEON_NEMESIS_DURATION", "600"),
        "PIGEON_NEMESIS_RESULTS": os.environ.get(
            "PIGEON_NEMESIS_RESULTS",
            os.path.join(tempfile.gettempdir(), "pigeon-nemesis-results.json"),
        ),
    }
    session.run(
        "python",
        "-m",
        "pytest",
        "-q",
        "-s",
        "integration/nemesis/test_nemesis.py",
        "-k",
        "secure",
        *session.posargs,
        env=env,
    )


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """Everything CI runs: unit tests, then the integration suite."""
    session.run("python", "-m", "pytest", "-q", *UNIT_PATHS, "integration", *session.posargs)


@nox.session(venv_backend="none")
def wheels(session: nox.Session) -> None:
    """``bash scripts/build-wheels [DIR]``; then, in any venv,
    ``pip install --find-links dist -c dist/constraints.txt pigeon-client``."""
    session.run("bash", "scripts/build-wheels", *session.posargs, external=True)


@nox.session(venv_backend="none")
def lint(session: nox.Session) -> None:
    """ruff over the tree, mypy strict over core, client, broker and spark."""
    session.run("ruff", "check", ".")
    session.run("mypy", *TYPED_SOURCES)


@nox.session(venv_backend="none")
def spark(session: nox.Session) -> None:
    """The Spark connector against a real standalone and local[2] Spark."""
    session.run("python", "-m", "pytest", "-q", *SPARK_TESTS, *session.posargs)


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """Every benchmark: PigeonMQ scenarios, then the side-by-side with peers.

    Writes docs/benchmarks.md and docs/img/. Peers need Debian's nats-server and
    redis-server; the Python clients come from requirements-bench.txt.
    """
    session.run("python", "-m", "pip", "install", "-q", "-r", "requirements-bench.txt")
    session.run("python", "-m", "bench", *session.posargs)
    session.run("python", "-m", "bench.compare")


#: ``bench_storage``: produce (1 and 16 producers) and latency of ``segment-files`` and
#: ``journal`` beside Tansu; then catch-up from bookies (both storages) and from an
#: offloaded backlog, with a 1 MiB broker tail cache so that every read is a storage read
BENCH_STORAGE = [
    ["--systems", "pigeon", "pigeon-journal", "tansu", "nats", "--scenarios", "produce",
     "multi", "latency", "--producers", "1", "16", "--rates", "10", "--diag-rates", "10",
     "--duration", "5", "--latency-duration", "5", "--repeat", "3"],
    ["--systems", "pigeon", "pigeon-journal", "pigeon-offloaded", "--scenarios", "catchup",
     "--backlog-mb", "256", "--repeat", "3", "--broker-config", "cache_max_bytes=1048576"],
]  # fmt: skip


@nox.session(venv_backend="none")
def bench_storage(session: nox.Session) -> None:
    """The storage backends: writes the Storage backends and Catch-up from offloaded
    segments sections of docs/benchmarks.md."""
    session.run("python", "-m", "pip", "install", "-q", "-r", "requirements-bench.txt")
    for args in BENCH_STORAGE:
        session.run("python", "-m", "bench.compare", *args, *session.posargs)
