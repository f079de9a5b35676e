"""Settings for every test of the monorepo.

Hypothesis: no per-example deadline (a loaded 2-core CI machine is slow, not wrong), and
under CI (``CI=true``) a fixed derandomized seed, so a run is repeatable: a failure found
there replays here with ``CI=true``.  Random exploration stays on for developers.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("pigeon", deadline=None)
settings.register_profile("pigeon-ci", deadline=None, derandomize=True, database=None)
settings.load_profile("pigeon-ci" if os.environ.get("CI") else "pigeon")
