"""Fixtures for integration tests: real ``pigeon standalone`` processes on loopback.

Only tests under ``integration/`` see these fixtures; nothing here changes how the unit
test directories are collected or run.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from pigeon.core.testing.servers import Standalone

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:  # helpers import as top-level modules, whatever the import mode
    sys.path.insert(0, _HERE)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    setattr(item, f"_pigeon_report_{report.when}", report)
    return report


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


@pytest.fixture
def standalone(standalone_factory: Callable[..., Standalone]) -> Standalone:
    """A running ``pigeon standalone`` (fsync always) on free ports, data under tmp_path."""
    return standalone_factory().start()
