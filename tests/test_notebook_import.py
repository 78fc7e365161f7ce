"""Importing nanoref in a Jupyter kernel prints nothing, with or without ipywidgets (a cell's stray stderr fails
strict nbval, and tells a learner nothing)."""

from __future__ import annotations

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed")
nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed")


@pytest.mark.parametrize("widgets", ["installed", "missing"])
def test_importing_nanoref_in_a_kernel_prints_nothing(widgets):
    block = 'import sys\nsys.modules["ipywidgets"] = None  # as where ipywidgets is not installed\n'
    source = (block if widgets == "missing" else "") + "import nanoref\nfrom nanoref import LLM\nprint('ok')"
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
    nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3").execute()
    outputs = notebook.cells[0].outputs
    assert [(o.get("name"), o.get("text")) for o in outputs] == [("stdout", "ok\n")], outputs
