"""The dashboard's ``units.js`` writes numbers, sizes, rates and durations as the CLI does
(``pigeon.client._units``): the same inputs give the same text.  Runs the script under
node (skipped without it); the page itself is checked in headless Chromium by
``integration/test_admin_dashboard.py``."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from pigeon.broker import _admin
from pigeon.client import _units

UNITS_JS = Path(_admin.__file__).parent / "dashboard" / "units.js"

CASES = {
    "size": [0, 999, 1000, 1500, 16_920_763.2, 5 * 1024 * 1024, 3 * 10**12, -1],
    "rate": [0, 512, 16_920_763.2],
    "duration": [0, 1, 59, 60, 90, 3600, 5400, 86400, 4 * 3600, 7 * 86400 + 1, -1],
    "number": [0, 7, 86400, 1234567],
}


def test_units_js_matches_the_cli() -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    script = (
        f"const u = require({json.dumps(str(UNITS_JS))});"
        f"const cases = {json.dumps(CASES)};"
        "const out = {};"
        "for (const [fn, values] of Object.entries(cases)) out[fn] = values.map((v) => u[fn](v));"
        "out.plural = [u.plural(1, 'message'), u.plural(2, 'message'), u.plural(1000, 'message')];"
        "console.log(JSON.stringify(out));"
    )
    result = subprocess.run(
        [node, "-e", script], capture_output=True, text=True, timeout=30, check=True
    )
    got = json.loads(result.stdout)
    for fn, values in CASES.items():
        assert got[fn] == [getattr(_units, fn)(v) for v in values], fn
    assert got["plural"] == ["1 message", "2 messages", "1,000 messages"]
    assert got["rate"][2] == "16.9 MB/s"
    assert got["duration"][7] == "1 d"
