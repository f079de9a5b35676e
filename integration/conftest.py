"""Fixtures for integration tests: real ``pigeon standalone`` processes on loopback.

Only tests under ``integration/`` see these fixtures; nothing here changes how the unit
test directories are collected or run.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from pigeon.core.testing.servers import Standalone

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:  # helpers import as top-level modules, whatever the import mode
    sys.path.insert(0, _HERE)


#: servers of ``module_standalone_factory``: a failed test that used one gets its log
_SHARED: list[Standalone] = []


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    setattr(item, f"_pigeon_report_{report.when}", report)
    if report.failed and _SHARED:
        used = getattr(item, "funcargs", {}).values()
        for server in _SHARED:
            if any(value is server for value in used):
                report.sections.append(
                    (f"shared standalone log {server.log_path}", server.log_tail(80))
                )
    return report


#: ``PIGEON_CLUSTER_MATRIX=full`` (``nox -s cluster`` sets it): every cell of the tests
#: marked ``ci_cells``; otherwise (``nox -s tests``, CI) only the cells the mark names
CLUSTER_MATRIX_ENV = "PIGEON_CLUSTER_MATRIX"
_CELLS_DESELECTED = pytest.StashKey[int]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "ci_cells(*ids): run only these parametrizations (pytest ids such as"
        f" 'etcd-lf') unless {CLUSTER_MATRIX_ENV}=full",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect (not skip) the cells of ``ci_cells`` tests that CI does not run: the full
    metadata x replication matrix is ``nox -s cluster``'s (``PIGEON_CLUSTER_MATRIX=full``)."""
    if os.environ.get(CLUSTER_MATRIX_ENV) == "full":
        return
    named = {arg for arg in config.args if "[" in arg}  # a cell asked for by its node id
    kept: list[pytest.Item] = []
    deselected: list[pytest.Item] = []
    for item in items:
        mark = item.get_closest_marker("ci_cells")
        callspec = getattr(item, "callspec", None)
        if (
            mark is None
            or callspec is None
            or callspec.id in mark.args
            or any(arg.endswith("::" + item.name) for arg in named)
        ):
            kept.append(item)
        else:
            deselected.append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept
        config.stash[_CELLS_DESELECTED] = len(deselected)


def pytest_report_collectionfinish(config: pytest.Config) -> str | None:
    count = config.stash.get(_CELLS_DESELECTED, 0)
    if not count:
        return None
    return (
        f"cluster matrix: {count} cells deselected (CI's subset of the metadata x"
        f" replication cells; {CLUSTER_MATRIX_ENV}=full or nox -s cluster runs them all)"
    )


def _failed(request: pytest.FixtureRequest) -> bool:
    return any(
        getattr(getattr(request.node, f"_pigeon_report_{when}", None), "failed", False)
        for when in ("setup", "call")
    )


@pytest.fixture
def standalone_factory(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., Standalone]]:
    """Build (not start) standalone servers with their own data dirs under tmp_path.

    Every server made here is killed (-9, by PID) at teardown; a failed test gets the tail
    of each server's log in its report.
    """
    made: list[Standalone] = []

    def make(name: str = "standalone", **kwargs: Any) -> Standalone:
        server = Standalone(tmp_path / name / "data", log_dir=tmp_path / name, **kwargs)
        made.append(server)
        return server

    yield make
    failed = _failed(request)
    for server in made:
        server.close()
        if failed and server.log_path is not None:
            sys.stdout.write(
                f"\n----- {server.log_path} (pid {server.proc.pid if server.proc else '?'}) -----\n"
                + server.log_tail(80)
                + "\n"
            )


@pytest.fixture(scope="module")
def module_standalone_factory(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Callable[..., Standalone]]:
    """Like ``standalone_factory``, for servers a whole module shares (tests that neither
    kill nor reconfigure them, each on its own topics): killed (-9, by PID) after the
    module's last test; a failed test that used one gets the tail of its log."""
    base = tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])
    made: list[Standalone] = []

    def make(name: str = "standalone", **kwargs: Any) -> Standalone:
        server = Standalone(base / name / "data", log_dir=base / name, **kwargs)
        made.append(server)
        _SHARED.append(server)
        return server

    yield make
    for server in made:
        server.close()
        _SHARED.remove(server)


@pytest.fixture
def standalone(standalone_factory: Callable[..., Standalone]) -> Standalone:
    """A running ``pigeon standalone`` (fsync always) on free ports, data under tmp_path."""
    return standalone_factory().start()


def _kafka_client_threads() -> int:
    """How many librdkafka clients (confluent-kafka) this process runs: each has one
    ``rdk:main`` thread until it is destroyed."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                count += comm.read().startswith("rdk:main")
        except OSError:
            continue
    return count


@pytest.fixture(autouse=True)
def _no_kafka_client_outlives_its_test() -> Iterator[None]:
    """Destroy the confluent-kafka clients a test left in a reference cycle (a
    ``pytest.raises`` result holds the test's frame, hence its clients; ``AdminClient``
    has no ``close``). Left to a later collection, they keep reconnecting to their dead
    server's port, and what listens there next (another test's server, Spark's JVM
    waiting for its Python worker) takes their bytes."""
    before = _kafka_client_threads() if sys.platform == "linux" else 0
    yield
    if sys.platform == "linux" and _kafka_client_threads() > before:
        gc.collect()
