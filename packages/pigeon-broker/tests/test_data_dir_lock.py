"""``pigeon standalone``'s data-dir LOCK: a live holder refuses a second server in one line;
a LOCK file left by a server killed with SIGKILL (its pid dead) never blocks a restart."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pigeon.broker._cli import _lock_data_dir
from pigeon.core.errors import DataDirLocked


def test_a_stale_lock_file_of_a_dead_pid_does_not_block_a_restart(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (tmp_path / "LOCK").write_text(f"{dead}\n")  # what a kill -9 leaves behind
    fd = _lock_data_dir(tmp_path)
    try:
        assert (tmp_path / "LOCK").read_text() == f"{os.getpid()}\n"
        # held now: a second server (another open file description) is told who holds it
        with pytest.raises(DataDirLocked, match=f"in use by pigeon standalone pid {os.getpid()}"):
            _lock_data_dir(tmp_path)
    finally:
        os.close(fd)
    os.close(_lock_data_dir(tmp_path))  # released with the descriptor (the process's end)
