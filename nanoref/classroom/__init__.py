"""The notebooks as a course: student copies made by nbgrader, a learner's own check, and the capstone's collector.

    python -m nanoref.classroom build --out course      # an nbgrader course; student copies in course/release/
    python -m nanoref.classroom check 07_model_and_sampling.ipynb   # does my copy pass? (each graded cell)

An exercise is a solution cell whose nbgrader `grade_id` is `ex_<seam>` (a seam of `nanoref.utils.seams.SEAMS`),
followed by a locked, graded test cell. nbgrader's own `generate_assignment` turns every solution region into
`raise NotImplementedError()`; `collect_solutions` gathers a learner's functions from their notebooks so the
capstone can run the engine with all of them at once.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import cloudpickle

from nanoref.utils.seams import SEAMS

REPO_ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"  # present in a source checkout (the course material lives there)
COURSE_ID = "nanoref"
UNSTARTED = "raise NotImplementedError"  # what nbgrader leaves in a solution region of a student copy


class ClassroomError(RuntimeError):
    """A course cannot be built, or a learner's exercises cannot be collected; the message says why."""


# -- reading notebooks -----------------------------------------------------------------------------------------
def _nbgrader(cell: dict) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def _source(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


@dataclass
class Exercise:
    seam: str  # the seam the exercise's function replaces
    notebook: Path
    source: str  # the solution cell's code
    started: bool  # False while the cell still holds nbgrader's `raise NotImplementedError()`


def exercises(notebook: str | Path) -> Iterator[Exercise]:
    """The exercises of one notebook, in order: solution cells whose grade_id is `ex_<seam>`."""
    notebook = Path(notebook)
    cells = json.loads(notebook.read_text()).get("cells", [])
    for cell in cells:
        meta = _nbgrader(cell)
        grade_id = str(meta.get("grade_id", ""))
        if cell.get("cell_type") != "code" or not meta.get("solution") or not grade_id.startswith("ex_"):
            continue
        source = _source(cell)
        yield Exercise(grade_id[3:], notebook, source, started=UNSTARTED not in source)


def _import_cell(exercise: Exercise, folder: Path) -> Callable:
    # a real file (not exec of a string): @triton.jit reads its kernel's source from the file
    module_name = f"nanoref_exercise_{exercise.seam}"
    path = folder / f"{module_name}.py"
    path.write_text(exercise.source)
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[module_name]
        raise ClassroomError(
            f"{exercise.notebook.name}, exercise `{exercise.seam}`: its cell fails on its own with "
            f"{type(error).__name__}: {error} (a solution cell must import what it needs at its top)"
        ) from None
    # a tensor-parallel engine sends the learner's functions to its worker processes, which cannot import this
    # module file: cloudpickle sends them by value instead
    cloudpickle.register_pickle_by_value(module)
    function = getattr(module, exercise.seam, None)
    if not callable(function):
        raise ClassroomError(
            f"{exercise.notebook.name}: the cell of exercise `{exercise.seam}` defines no function "
            f"named `{exercise.seam}`"
        )
    return function


def collect_solutions(folder: str | Path = ".", *, allow_unstarted: bool = False) -> dict[str, Callable]:
    """{seam: the learner's function} from the solution cells of every notebook in `folder`.

    Each cell is written to a module file of its own and imported, so it must be self-contained (its imports at
    its top). An exercise still holding `raise NotImplementedError()` is reported by name (ClassroomError), or
    left out with `allow_unstarted=True`.
    """
    folder = Path(folder)
    notebooks = sorted(folder.glob("*.ipynb"))
    if not notebooks:
        raise ClassroomError(f"no notebooks in {folder.resolve()}")
    found: list[Exercise] = [exercise for notebook in notebooks for exercise in exercises(notebook)]
    unknown = [f"{e.seam} ({e.notebook.name})" for e in found if e.seam not in SEAMS]
    if unknown:
        raise ClassroomError(f"exercises with no matching seam in nanoref.utils.seams.SEAMS: {', '.join(unknown)}")
    unstarted = [f"`{e.seam}` ({e.notebook.name})" for e in found if not e.started]
    if unstarted and not allow_unstarted:
        raise ClassroomError(
            f"{len(unstarted)} exercise(s) not written yet (still `raise NotImplementedError()`): "
            + ", ".join(unstarted)
        )
    modules = Path(tempfile.mkdtemp(prefix="nanoref-solutions-"))
    return {e.seam: _import_cell(e, modules) for e in found if e.started}


# -- building the course ---------------------------------------------------------------------------------------
NBGRADER_CONFIG = """\
# nbgrader configuration of the nanoref course (written by `python -m nanoref.classroom build`)
c = get_config()  # noqa: F821
c.CourseDirectory.course_id = {course_id!r}  # the course folder is the one nbgrader runs in (relocatable)
# a learner's solution region becomes exactly this (nbgrader's default, stated so the tests can rely on it)
c.ClearSolutions.code_stub = {{"python": "# YOUR CODE HERE\\nraise NotImplementedError()"}}
c.Execute.timeout = 600
"""

# files the notebooks read, relative to the repository root; copied next to the notebooks in the course
SUPPORT_FOLDERS = ("figures", "benchmarks/results")


def _self_contained(notebook: dict) -> dict:
    """The notebook with `../figures/` and `../benchmarks/` read from its own folder (the assignment's)."""
    for cell in notebook.get("cells", []):
        source = _source(cell)
        fixed = re.sub(r"\.\./(figures|benchmarks)/", r"\1/", source)
        if fixed != source:
            cell["source"] = fixed
    return notebook


def run_nbgrader(args: list[str], course: Path) -> subprocess.CompletedProcess:
    """nbgrader's own command line in `course`. Its gradebook runs `alembic` by name, so this interpreter's
    scripts folder goes first on the child's PATH (the caller's environment is left as it is)."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    result = subprocess.run(
        [sys.executable, "-m", "nbgrader", *args], cwd=course, env=env, capture_output=True, text=True
    )
    if result.returncode != 0:
        raise ClassroomError(f"nbgrader {' '.join(args)} failed:\n{result.stdout}{result.stderr}")
    return result


def build(
    out: str | Path,
    *,
    notebooks_dir: str | Path = NOTEBOOKS_DIR,
    assignment: str = COURSE_ID,
    select: list[str] | None = None,
) -> list[Path]:
    """Lay out an nbgrader course in `out` (config, source/<assignment>/ with the notebooks and the files they read)
    and run nbgrader's generate_assignment. Returns the student notebooks (out/release/<assignment>/*.ipynb).

    select: notebook names or prefixes ("07", "07_model_and_sampling.ipynb"); default every notebook.
    """
    notebooks_dir, out = Path(notebooks_dir), Path(out).resolve()
    if not notebooks_dir.is_dir():
        raise ClassroomError(f"no notebooks folder at {notebooks_dir} (build runs from a nanoref source checkout)")
    notebooks = sorted(notebooks_dir.glob("[0-9]*.ipynb"))
    if select:
        chosen = [nb for nb in notebooks if any(nb.name == s or nb.name.startswith(s) for s in select)]
        missing = [s for s in select if not any(nb.name == s or nb.name.startswith(s) for nb in notebooks)]
        if missing:
            raise ClassroomError(f"no notebook matches {', '.join(missing)} in {notebooks_dir}")
        notebooks = chosen
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", assignment):
        raise ClassroomError(f"assignment name {assignment!r}: use letters, digits, '_', '-' and '.' only")
    source = out / "source" / assignment
    if source.exists():
        shutil.rmtree(source)
    source.mkdir(parents=True)
    (out / "nbgrader_config.py").write_text(NBGRADER_CONFIG.format(course_id=COURSE_ID))
    for notebook in notebooks:
        content = _self_contained(json.loads(notebook.read_text()))
        (source / notebook.name).write_text(json.dumps(content, indent=1, ensure_ascii=False) + "\n")
    root = notebooks_dir.resolve().parent
    for folder in SUPPORT_FOLDERS:
        if (root / folder).is_dir():
            shutil.copytree(root / folder, source / folder)
    run_nbgrader(["generate_assignment", assignment, "--force", "--log-level=WARN"], out)
    return sorted((out / "release" / assignment).glob("*.ipynb"))


# -- a learner's check -----------------------------------------------------------------------------------------
@dataclass
class CellResult:
    grade_id: str
    points: float
    passed: bool
    message: str  # the error's last line when it failed


def check(notebook: str | Path, *, timeout: int = 600) -> list[CellResult]:
    """Run `notebook` top to bottom in its own folder (its file is left untouched) and report each graded cell."""
    import nbformat
    from nbclient import NotebookClient

    notebook = Path(notebook)
    nb = nbformat.read(notebook, as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        allow_errors=True,
        resources={"metadata": {"path": str(notebook.resolve().parent)}},
    )
    client.execute()
    results = []
    for cell in nb.cells:
        meta = _nbgrader(cell)
        if cell.cell_type != "code" or not meta.get("grade"):
            continue
        errors = [out for out in cell.get("outputs", []) if out.get("output_type") == "error"]
        message = ""
        if errors:
            error = errors[0]
            message = f"{error['ename']}: {error['evalue']}".strip()
            if error["ename"] == "NotImplementedError":
                message = "not written yet (NotImplementedError): fill in the solution cell above it"
        results.append(CellResult(str(meta.get("grade_id")), float(meta.get("points", 0)), not errors, message))
    return results


def _report(notebook: Path, results: list[CellResult]) -> int:
    if not results:
        print(f"{notebook.name}: no graded cells")
        return 0
    for result in results:
        verdict = "pass" if result.passed else "FAIL"
        print(f"{verdict}  {result.grade_id} ({result.points:g} points)" + ("" if result.passed else ":"))
        if not result.passed:
            print(textwrap.indent(textwrap.fill(result.message, 110), "      "))
    score = sum(r.points for r in results if r.passed)
    total = sum(r.points for r in results)
    print(f"{notebook.name}: {score:g} / {total:g} points")
    return 0 if score == total else 1
