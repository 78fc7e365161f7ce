"""The browsable copy of the notebooks builds (`mkdocs build --strict`) and holds their stored outputs."""

from __future__ import annotations

import html
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs_jupyter")
ROOT = Path(__file__).resolve().parents[1]


def last_stdout_line(notebook: Path) -> str:
    """The last line a code cell of the notebook printed (its stored output)."""
    cells = json.loads(notebook.read_text())["cells"]
    texts = [
        "".join(out["text"])
        for cell in cells
        if cell["cell_type"] == "code"
        for out in cell.get("outputs", [])
        if out.get("name") == "stdout"
    ]
    return [line for line in texts[-1].splitlines() if line.strip()][-1]


@pytest.mark.slow
def test_mkdocs_builds_the_notebooks_with_their_outputs(tmp_path):
    site = tmp_path / "site"
    # run from tmp_path: mkdocs-jupyter keeps its cache in .cache/ under the working folder
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-q",
            "-f",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(site),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (site / "teaching" / "index.html").is_file()
    notebooks = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))
    assert notebooks
    for notebook in notebooks:
        page = site / "notebooks" / notebook.stem / "index.html"
        assert page.is_file(), f"no page for {notebook.name}"
    tour = html.unescape((site / "notebooks" / "00_tour" / "index.html").read_text())
    assert last_stdout_line(ROOT / "notebooks" / "00_tour.ipynb") in tour  # a stored output, not re-run
