"""Server process settings (pigeon.core._runtime): a server's malloc keeps freed memory,
so buffers of megabytes allocated again do not page-fault and zero-fill anew."""

from __future__ import annotations

import subprocess
import sys

import pytest

#: allocates 40 MB in 2 MB buffers, frees them, allocates them again: prints the page
#: faults of the second round (the first one warms malloc up either way)
_ROUNDS = """
import resource, sys
from pigeon.core._runtime import retain_freed_memory
if sys.argv[1] == "retain" and not retain_freed_memory():
    print("unsupported")
    raise SystemExit
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
warm = bytearray(2 << 20)
del warm
bufs = [bytearray(2 << 20) for _ in range(20)]
del bufs
before = faults()
bufs = [bytearray(2 << 20) for _ in range(20)]
print(faults() - before)
"""


def faults_of_second_round(mode: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", _ROUNDS, mode], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_server_reuses_freed_buffers_without_faults() -> None:
    retained = faults_of_second_round("retain")
    if retained == "unsupported":
        pytest.skip("not glibc's malloc")
    default = int(faults_of_second_round("default"))
    # 40 MB is 10,240 pages: given back to the kernel by default, kept for a server
    assert default > 5000
    assert int(retained) < 1000
