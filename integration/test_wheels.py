"""Installing PigeonMQ as a user does: ``bash scripts/build-wheels`` builds a wheel of every
package and plugin, ``pip install --find-links dist -c dist/constraints.txt pigeon-client``
installs the client in an empty venv (pigeon-core found beside it in ``dist``; the
constraints pin each PigeonMQ name to its wheel, as PyPI holds an unrelated
``pigeon-client``), and ``pigeon --version`` prints each installed PigeonMQ distribution,
through the real ``pigeon`` command.

Offline: the wheels build with the venv's hatchling (or pip's isolated build if it has none),
and the client's dependencies (trio, pycapnp, ...) come from wheels made here of the test
venv's own installed copies, so the install uses no package index at all.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from pigeon.core.testing.servers import clean_env, pigeon_command

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
#: every folder scripts/build-wheels builds
PROJECTS = sorted(
    p.parent
    for p in [*ROOT.glob("packages/*/pyproject.toml"), *ROOT.glob("plugins/*/pyproject.toml")]
)
BUILD_TIMEOUT = 240.0  # pip's isolated builds fetch hatchling once per package
INSTALL_TIMEOUT = 120.0


def run(
    cmd: list[str], timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env if env is not None else clean_env(),
        stdin=subprocess.DEVNULL,
        check=False,
    )


def project_version(project: Path) -> str:
    match = re.search(r'^version = "([^"]+)"', (project / "pyproject.toml").read_text(), re.M)
    assert match, project
    return match.group(1)


def test_version_lists_each_installed_pigeonmq_distribution(tmp_path: Path) -> None:
    """``pigeon --version``: one ``NAME VERSION`` line per PigeonMQ distribution, pigeon-core
    first, a third-party plugin included, none of their dependencies; exit 0."""
    site = tmp_path / "site"
    dist = site / "pigeon_elsewhere-2.5.dist-info"
    dist.mkdir(parents=True)
    (site / "pigeon_elsewhere.py").write_text("")
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: pigeon-elsewhere\nVersion: 2.5\n")
    (dist / "entry_points.txt").write_text("[pigeon]\nelsewhere = pigeon_elsewhere\n")
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))

    result = run([*pigeon_command(), "--version"], 60.0, env)

    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"pigeon-core {metadata.version('pigeon-core')}"
    for name in ("pigeon-client", "pigeon-broker", "pigeon-bookie"):
        assert f"{name} {metadata.version(name)}" in lines
    assert "pigeon-elsewhere 2.5" in lines
    assert all(re.fullmatch(r"\S+ \S+", line) for line in lines), lines
    assert not any(line.startswith(("trio ", "click ", "pluggy ")) for line in lines), lines


def dependency_closure(names: list[str]) -> list[metadata.Distribution]:
    """The installed distributions that ``names`` need (not PigeonMQ's own), transitively."""
    seen: dict[str, metadata.Distribution] = {}
    todo = [(n, frozenset[str]()) for n in names]
    while todo:
        name, extras = todo.pop()
        dist = metadata.distribution(name)
        for line in dist.requires or ():
            req = Requirement(line)
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in (extras or {""})):
                continue
            key = canonicalize_name(req.name)
            if key.startswith("pigeon-") or key in seen:
                continue
            seen[key] = metadata.distribution(req.name)
            todo.append((req.name, frozenset(req.extras)))
    return list(seen.values())


def wheel_of_installed(dist: metadata.Distribution, into: Path) -> Path:
    """A wheel of ``dist`` as installed here: its files under site-packages and its
    ``.dist-info`` (scripts are made again by pip from ``entry_points.txt``)."""
    info = next(f for f in dist.files or () if f.parts[0].endswith(".dist-info"))
    info_dir = info.parts[0]
    wheel_file = dist.read_text("WHEEL")  # None: not installed from a wheel
    tags = [
        line.split(":", 1)[1].strip()
        for line in (wheel_file or "Tag: py3-none-any\n").splitlines()
        if line.startswith("Tag:")
    ]
    name = re.sub(r"[-_.]+", "_", dist.metadata["Name"])
    # the compressed tag set, e.g. py2.py3-none-any
    tag = "-".join(".".join(sorted({t.split("-")[i] for t in tags})) for i in range(3))
    wheel = into / f"{name}-{dist.version}-{tag}.whl"
    record = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as zf:
        for f in dist.files or ():
            path = f.as_posix()
            if path.startswith("..") or "__pycache__" in path or path == f"{info_dir}/RECORD":
                continue
            if path in (
                f"{info_dir}/INSTALLER",
                f"{info_dir}/REQUESTED",
                f"{info_dir}/direct_url.json",
            ):
                continue
            source = Path(str(dist.locate_file(f)))
            if not source.is_file():
                continue
            data = source.read_bytes()
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            zf.writestr(path, data)
            record.append(f"{path},sha256={digest},{len(data)}")
        if wheel_file is None:
            zf.writestr(f"{info_dir}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n")
            record.append(f"{info_dir}/WHEEL,,")
        record.append(f"{info_dir}/RECORD,,")
        zf.writestr(f"{info_dir}/RECORD", "\n".join(record) + "\n")
    return wheel


def test_client_installs_from_built_wheels_in_an_empty_venv(tmp_path: Path) -> None:
    """``bash scripts/build-wheels`` then ``pip install --find-links dist -c
    dist/constraints.txt pigeon-client`` in a new venv: pigeon-core comes from ``dist`` with
    it, the client imports, and the venv's ``pigeon --version`` names exactly those two."""
    dist = tmp_path / "dist"
    env = clean_env()
    env["PYTHON"] = sys.executable
    built = run(["bash", str(ROOT / "scripts" / "build-wheels"), str(dist)], BUILD_TIMEOUT, env)
    if built.returncode != 0:
        pytest.skip(
            f"cannot build wheels here (no hatchling, no package index): {built.stderr[-500:]}"
        )
    # pure-Python wheels, but pigeon-client's: its C extension (the sync producer's hot
    # path) makes it a wheel of this Python and platform
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    client_tag = f"{py}-{py}-{sysconfig.get_platform().replace('-', '_').replace('.', '_')}"
    expected = {
        p.name: f"{p.name.replace('-', '_')}-{project_version(p)}-"
        + (client_tag if p.name == "pigeon-client" else "py3-none-any")
        + ".whl"
        for p in PROJECTS
    }
    assert sorted(p.name for p in dist.glob("*.whl")) == sorted(expected.values()), built.stdout
    # each PigeonMQ name pinned to its wheel (PyPI holds an unrelated pigeon-client)
    assert sorted((dist / "constraints.txt").read_text().splitlines()) == sorted(
        f"{name} @ {(dist / wheel).as_uri()}" for name, wheel in expected.items()
    )

    wheelhouse = tmp_path / "wheelhouse"
    wheelhouse.mkdir()
    for needed in dependency_closure(["pigeon-client", "pigeon-core"]):
        wheel_of_installed(needed, wheelhouse)
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], 60.0).check_returncode()
    python = venv / "bin" / "python"
    offline = clean_env()
    offline["PIP_CONFIG_FILE"] = os.devnull  # no index, mirror or find-links of the machine
    for key in [k for k in offline if k.startswith("PIP_") and k != "PIP_CONFIG_FILE"]:
        del offline[key]
    offline.pop("PYTHONPATH", None)
    installed = run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "-q",
            "--no-compile",
            "--no-index",
            "--find-links",
            str(dist),
            "-c",
            str(dist / "constraints.txt"),
            "--find-links",
            str(wheelhouse),
            "pigeon-client",
        ],
        INSTALL_TIMEOUT,
        offline,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr

    version = run([str(venv / "bin" / "pigeon"), "--version"], 60.0, offline)
    assert version.returncode == 0, version.stderr
    assert version.stdout.splitlines() == [
        f"pigeon-core {project_version(ROOT / 'packages' / 'pigeon-core')}",
        f"pigeon-client {project_version(ROOT / 'packages' / 'pigeon-client')}",
    ]
    imported = run(
        [
            str(python),
            "-c",
            "import pigeon.client, pigeon.core; from pigeon.client import _fast;"
            " print(pigeon.client.__file__); print(_fast.SPEEDUPS)",
        ],
        60.0,
        offline,
    )
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.startswith(str(venv)), imported.stdout
    # the extension is built where a C compiler is, and loads from the wheel
    built_c = shutil.which(os.environ.get("CC", "cc")) is not None
    assert imported.stdout.split()[1:] == [str(built_c)], "the wheel's C extension"
