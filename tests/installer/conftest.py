"""Fixtures for the installer tests: a wheelhouse for installs that must not reach any
package index."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "installer" / "requirements-cpu.lock"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "installer: runs the real Linux installer (a venv with torch, minutes)"
    )


@pytest.fixture(scope="session")
def wheelhouse() -> Path:
    """Every wheel of installer/requirements-cpu.lock in one folder.

    Built once and kept across sessions, keyed by the lock's hash, in
    ``$FOLIO_TEST_WHEELHOUSE`` or ``~/.cache/folio-tests/wheelhouse-<hash>``: ``pip
    download`` fetches through pip's configured indexes (and its cache) the first
    time; afterwards the installer tests install from it with ``--no-index``.
    """
    if not LOCK.exists():
        pytest.skip("no installer/requirements-cpu.lock")
    digest = hashlib.sha256(LOCK.read_bytes()).hexdigest()[:16]
    base = os.environ.get("FOLIO_TEST_WHEELHOUSE") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "folio-tests")
    house = Path(base) / f"wheelhouse-{digest}"
    if (house / ".complete").exists():
        return house
    tmp = house.with_name(house.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes",
         "-r", str(LOCK), "-d", str(tmp), "--progress-bar", "off", "-q"],
        capture_output=True, text=True, timeout=1800,
    )
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        pytest.fail(f"could not build the wheelhouse:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    (tmp / ".complete").write_text(digest + "\n")
    shutil.rmtree(house, ignore_errors=True)
    os.replace(tmp, house)
    return house
