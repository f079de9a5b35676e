"""Choosing the ledger storage: ``pigeon bookie --storage NAME``, ``pigeon standalone
--storage NAME`` and the ``ledger_storage`` key, through the real ``pigeon`` command.

A storage plugin installed for these tests (an entry point of a distribution on the
child's PYTHONPATH, as ``pip install`` would leave it) registers ``elsewhere``: the
``segment-files`` engine on ``<data_dir>/elsewhere``, so that the files show which
backend the bookie built."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pigeon.core.testing.servers import Standalone, clean_env, free_port, pigeon_command

pytestmark = pytest.mark.integration

TIMEOUT = 60

PLUGIN = """
import os
import pluggy

hookimpl = pluggy.HookimplMarker("pigeon")


@hookimpl
def pigeon_ledger_storages(registry):
    from pigeon.bookie import SegmentStore

    def elsewhere(config):
        return SegmentStore(os.path.join(config.data_dir, "elsewhere"), fsync=config.fsync)

    registry.register("elsewhere", elsewhere)
"""


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """The environment of a ``pigeon`` process with the ``elsewhere`` plugin installed."""
    site = tmp_path / "site"
    dist = site / "pigeon_elsewhere-1.0.dist-info"
    dist.mkdir(parents=True)
    (site / "pigeon_elsewhere.py").write_text(PLUGIN)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: pigeon-elsewhere\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[pigeon]\nelsewhere = pigeon_elsewhere\n")
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(site), *(p for p in sys.path if p)])
    return env


def pigeon(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*pigeon_command(), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        stdin=subprocess.DEVNULL,
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_plugins_lists_ledger_storages(env: dict[str, str]) -> None:
    result = pigeon(env, "plugins")
    assert result.returncode == 0, result.stderr
    assert "ledger storages: elsewhere, journal, segment-files" in result.stdout


def run_bookie_until_ready(env: dict[str, str], *args: str) -> str:
    """Start ``pigeon bookie ARGS``, wait (bounded) for its ready line, stop it with
    SIGTERM (by PID); its stderr."""
    proc = subprocess.Popen(
        [*pigeon_command(), "bookie", *args],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    ready = threading.Event()

    def drain() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "bookie ready on" in line:
                ready.set()
        ready.set()  # it exited

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        assert ready.wait(TIMEOUT), "".join(lines)
        assert proc.poll() is None, "".join(lines)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(TIMEOUT)
        reader.join(TIMEOUT)
        assert proc.stderr is not None
        proc.stderr.close()
    return "".join(lines)


def test_bookie_storage_flag_builds_the_named_backend(env: dict[str, str], tmp_path: Path) -> None:
    data = tmp_path / "data"
    common = ["--metadata", f"embedded://{tmp_path / 'meta'}", "--port", str(free_port())]
    run_bookie_until_ready(env, *common, "--data-dir", str(data), "--storage", "elsewhere")
    assert (data / "elsewhere" / "FORMAT").exists()
    assert not (data / "segments").exists()
    # the default is segment-files
    run_bookie_until_ready(env, *common, "--data-dir", str(tmp_path / "default"))
    assert (tmp_path / "default" / "segments").is_dir()


def test_bookie_unknown_storage_is_a_one_line_error(env: dict[str, str], tmp_path: Path) -> None:
    common = ["bookie", "--metadata", f"embedded://{tmp_path / 'meta'}"]
    result = pigeon(env, *common, "--data-dir", str(tmp_path / "d"), "--storage", "nope")
    assert_one_line_error(result, "ledger_storage", "'nope'", "elsewhere, journal, segment-files")
    # the same from the [bookie] table of a configuration file
    config = tmp_path / "bookie.toml"
    config.write_text('[bookie]\nledger_storage = "journal-typo"\n')
    result = pigeon(env, *common, "--data-dir", str(tmp_path / "d"), "--config", str(config))
    assert_one_line_error(result, "ledger_storage", "'journal-typo'", "segment-files")
    assert not (tmp_path / "d").exists()


def test_standalone_storage_flag(
    env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])
    server = Standalone(tmp_path / "sa", storage="elsewhere")
    try:
        server.start()
        assert (tmp_path / "sa" / "bookie" / "elsewhere" / "FORMAT").exists()
        assert not (tmp_path / "sa" / "bookie" / "segments").exists()
        assert server.terminate() == 0
    finally:
        server.close()
    result = pigeon(
        env,
        "standalone",
        "--data-dir",
        str(tmp_path / "bad"),
        "--storage",
        "nope",
        "--port",
        str(free_port()),
        "--bookie-port",
        str(free_port()),
        "--http-port",
        "-1",
        "--kafka-port",
        "-1",
    )
    assert_one_line_error(result, "ledger_storage", "'nope'", "segment-files")
