"""Run a script under cProfile with a per-thread CPU clock (time spent waiting for the
CPU or in another thread is not counted), dumping the stats when it exits:

    python bench/_profile.py OUT.prof SCRIPT [ARGS...]

Used by ``BENCH_PIGEON_PROFILE=OUT.prof`` (see ``bench.__main__.Standalone``): the
server's event-loop thread is profiled; its worker threads (fsync) are not.
"""

from __future__ import annotations

import cProfile
import runpy
import sys
import time


def main() -> None:
    out, script = sys.argv[1], sys.argv[2]
    sys.argv = sys.argv[2:]
    prof = cProfile.Profile(time.thread_time)
    try:
        prof.runcall(runpy.run_path, script, run_name="__main__")
    finally:
        prof.dump_stats(out)


if __name__ == "__main__":
    main()
