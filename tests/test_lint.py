"""The package and tests stay clean under the project's ruff rules (pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(
    shutil.which("ruff") is None and not (Path(sys.prefix) / "bin" / "ruff").exists(), reason="ruff missing"
)
def test_ruff_check():
    ruff = shutil.which("ruff") or str(Path(sys.prefix) / "bin" / "ruff")
    result = subprocess.run([ruff, "check", "nanoref", "tests", "benchmarks"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
