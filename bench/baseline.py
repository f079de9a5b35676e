"""Compare a scenario against a previous commit, in the same session.

    python -m bench --scenario cluster --duration 10 --no-docs --baseline 84966a7

The commit's packages are unpacked with ``git archive`` into a temporary directory, and
the scenario runs in turn on them and on the working tree (``python -m bench`` in a child
process whose ``PYTHONPATH`` points at one tree's package sources: the client in the
child and the servers it starts use that tree's code; the harness is always this one).
Runs alternate, ABBA, so that a load that comes and goes on a shared machine falls on both
sides alike; the figures are the medians per side and their ratio (working tree /
baseline, higher is better for every figure here: MB/s and msg/s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def source_path(tree: Path) -> str:
    """``PYTHONPATH`` of a tree's package sources (``packages/*/src``, ``plugins/*/src``)."""
    dirs = sorted(tree.glob("packages/*/src")) + sorted(tree.glob("plugins/*/src"))
    return os.pathsep.join(str(d) for d in dirs)


def unpack(rev: str, into: Path) -> Path:
    """The packages and plugins of commit ``rev``, unpacked under ``into``."""
    archive = into / "baseline.tar"
    subprocess.run(
        ["git", "-C", str(ROOT), "archive", "-o", str(archive), rev, "packages", "plugins"],
        check=True,
    )
    tree = into / "baseline"
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    return tree


def alternate_children(
    module: str,
    baseline: str | None,
    rounds: int,
    extra: list[str],
    *,
    topic: str,
    **standalone: Any,
) -> dict[str, list[dict[str, Any]]]:
    """Run ``python -m MODULE --child URL TOPIC-SIDE-ROUND *extra`` ``rounds`` times per
    side against one ``pigeon standalone`` (``standalone``: its options), the working
    tree's packages (side ``work``) and, with ``baseline``, that commit's (side
    ``baseline``), alternating ABBA; each child prints its result as JSON on its last
    line. Returns the results per side, in run order (baseline first)."""
    from bench.__main__ import Standalone

    with tempfile.TemporaryDirectory(prefix=f"pigeon-{topic}-") as tmp:
        sides = {"work": source_path(ROOT)}
        if baseline:
            sides = {"baseline": source_path(unpack(baseline, Path(tmp))), **sides}
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
        data = Path(tmp) / "data"
        data.mkdir()
        with Standalone(data, **standalone) as server:
            for i in range(rounds):
                order = list(sides) if i % 2 == 0 else list(reversed(sides))
                for side in order:
                    env = dict(os.environ, PYTHONPATH=f"{sides[side]}{os.pathsep}{ROOT}")
                    cmd = [sys.executable, "-m", module, "--child", server.url]
                    cmd += [f"{topic}-{side}-{i}", *extra]
                    done = subprocess.run(
                        cmd, check=True, cwd=ROOT, env=env, capture_output=True, text=True
                    )
                    got = json.loads(done.stdout.strip().splitlines()[-1])
                    print(f"round {i + 1} {side}: {got}", file=sys.stderr)
                    runs[side].append(got)
    return runs


def figures(results: dict[str, Any]) -> dict[str, float]:
    """The headline rates of one run: ``<part> MB/s`` for every part that has one."""
    return {
        f"{key} MB/s": float(value["mb_per_s"])
        for key, value in results.items()
        if isinstance(value, dict) and "mb_per_s" in value
    }


def run_once(child_args: list[str], pythonpath: str, out: Path) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=pythonpath)
    cmd = [sys.executable, "-m", "bench", *child_args, "--no-docs", "--json", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    return figures(json.loads(out.read_text()))


def compare(args: argparse.Namespace, child_args: list[str]) -> dict[str, Any]:
    """Run the scenario ``args.rounds`` times per side, alternating; print the table."""
    runs: dict[str, list[dict[str, float]]] = {"baseline": [], "work": []}
    with tempfile.TemporaryDirectory(prefix="pigeon-baseline-") as tmp:
        paths = {
            "baseline": source_path(unpack(args.baseline, Path(tmp))),
            "work": source_path(ROOT),
        }
        for i in range(args.rounds):
            order = ("baseline", "work") if i % 2 == 0 else ("work", "baseline")
            for side in order:
                got = run_once(child_args, paths[side], Path(tmp) / f"{side}-{i}.json")
                print(f"round {i + 1} {side}: {got}", file=sys.stderr)
                runs[side].append(got)
    rows = []
    for name in runs["baseline"][0]:
        base = statistics.median(r[name] for r in runs["baseline"])
        work = statistics.median(r[name] for r in runs["work"])
        rows.append({"figure": name, "baseline": base, "work": work, "ratio": work / base})
    print(render(args.baseline, rows, runs))
    return {"baseline": args.baseline, "rows": rows, "runs": runs}


def render(rev: str, rows: list[dict[str, Any]], runs: dict[str, list[Any]]) -> str:
    n = len(runs["work"])
    lines = [
        f"| figure (median of {n} runs each, alternating) | {rev} | working tree | ratio |",
        "|---|---|---|---|",
    ]
    for row in rows:
        each = ", ".join(f"{r[row['figure']]:g}" for r in runs["baseline"])
        each_w = ", ".join(f"{r[row['figure']]:g}" for r in runs["work"])
        lines.append(
            f"| {row['figure']} | {row['baseline']:g} ({each}) | {row['work']:g} ({each_w})"
            f" | {row['ratio']:.2f} |"
        )
    return "\n".join(lines)
