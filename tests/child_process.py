"""Run a Python snippet in a fresh interpreter from the repository root and read the JSON
object it prints last (tests that need a process of their own: another instruction-set
path, a clean peak RSS)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_json(
    script: str, *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])
