"""environment.yml (conda) and pyproject.toml (pip) must name the same packages."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

ROOT = Path(__file__).resolve().parent.parent


def _name(requirement: str) -> str:
    """'triton>=3.0; platform_system == "Linux"' -> 'triton' (PEP 503 normalised)."""
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1)
    return re.sub(r"[-_.]+", "-", name).lower()


def pyproject_packages() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = project["dependencies"] + [r for extra, reqs in extras.items() if extra != "flash" for r in reqs]
    return {_name(r) for r in wanted if not _name(r).startswith("nanoref")}


def environment_packages() -> tuple[set[str], set[str]]:
    """(packages of the pip list, packages named only in comments of it)."""
    text = (ROOT / "environment.yml").read_text()
    pip_list = text.split("- pip:", 1)[1]
    listed = {_name(m) for m in re.findall(r"^\s*-\s+([A-Za-z0-9][^\s#]*)", pip_list, flags=re.M)}
    commented = {_name(m) for m in re.findall(r"^\s*#\s*-\s+([A-Za-z0-9][^\s#]*)", pip_list, flags=re.M)}
    return listed, commented


def test_environment_yml_lists_what_pyproject_declares():
    listed, commented = environment_packages()
    declared = pyproject_packages()
    assert declared - listed == set(), f"in pyproject.toml but not in environment.yml: {sorted(declared - listed)}"
    assert listed - declared == set(), f"in environment.yml but not in pyproject.toml: {sorted(listed - declared)}"
    assert "flash-attn" in commented, "environment.yml should show CUDA users the flash-attn line"


def test_the_setup_script_installs_the_dev_extra_and_says_what_it_does():
    script = (ROOT / ".ci" / "with-venv").read_text()
    assert '-e ".[dev]"' in script
    assert [f"{i}/4" in script for i in range(1, 5)] == [True] * 4, "one progress line per setup stage"


def test_the_setup_script_pins_one_torch_release_on_every_machine():
    """A GPU machine gets PyPI's CUDA build of the same release a CPU machine gets, never whatever pip serves."""
    script = (ROOT / ".ci" / "with-venv").read_text()
    assert re.search(r"^TORCH_VERSION=\d+\.\d+\.\d+ ", script, re.M), "one pinned torch release"
    installs = [line.strip() for line in script.splitlines() if line.strip().startswith('"${pip[@]}" ')]
    torch_installs = [line for line in installs if "torch" in line]
    assert len(torch_installs) == 3, torch_installs  # CUDA, an explicit index, the default CPU build
    assert all(line.startswith('"${pip[@]}" "$torch_pin"') for line in torch_installs), torch_installs


def test_the_packages_version_is_pyprojects():
    """`nanoref.__version__` (what the server's /version returns, installed or not) is the version pip installs."""
    import nanoref

    assert nanoref.__version__ == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


# a notebook's import -> the distribution that brings it, where the names differ
DISTRIBUTION_OF = {"IPython": "ipykernel", "yaml": "pyyaml", "PIL": "pillow"}


def test_the_notebooks_extra_brings_every_package_a_notebook_imports():
    """`pip install nanoref[notebooks]` (and `[classroom]`, which includes it) is enough to run every notebook: each
    top-level import of a notebook's code cells is the standard library's, nanoref's, an engine dependency, or in the
    extra; and each package `nanoref.testing.NOTEBOOK_NEEDS` names is declared there (or is an engine dependency)."""
    import ast
    import json
    import sys

    from nanoref.testing import NOTEBOOK_NEEDS

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    provided = {_name(r) for r in project["dependencies"] + project["optional-dependencies"]["notebooks"]}
    assert "nanoref[notebooks]" in project["optional-dependencies"]["classroom"]
    missing = {}
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(notebook.read_text())["cells"]
        sources = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
        # (a cell magic's body need not be Python; a line magic or shell line is not: both left out)
        sources = [src for src in sources if not src.lstrip().startswith("%%")]
        tree = ast.Module(body=[], type_ignores=[])
        for src in sources:
            lines = [line for line in src.splitlines() if not line.lstrip().startswith(("%", "!"))]
            tree.body += ast.parse("\n".join(lines)).body
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in (n.split(".")[0] for n in names):
                if name in sys.stdlib_module_names or name == "nanoref":
                    continue
                if _name(DISTRIBUTION_OF.get(name, name)) not in provided:
                    missing.setdefault(notebook.name, set()).add(name)
        for package in NOTEBOOK_NEEDS.get(notebook.stem, ()):
            if _name(package) not in provided:
                missing.setdefault(notebook.name, set()).add(package)
    assert missing == {}, f"imported by notebooks but not in the notebooks extra: {missing}"
