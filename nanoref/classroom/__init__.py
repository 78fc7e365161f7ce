"""The notebooks as a course: student copies made by nbgrader, a learner's own check, and the capstone's collector.

    python -m nanoref.classroom build --out course      # an nbgrader course; student copies in course/release/
    python -m nanoref.classroom check 07_model_and_sampling.ipynb   # does my copy pass? (each graded cell)

An exercise is a solution cell whose nbgrader `grade_id` is `ex_<seam>` (a seam of `nanoref.utils.seams.SEAMS`),
followed by a locked, graded test cell. nbgrader's own `generate_assignment` turns every solution region into
`raise NotImplementedError()`; `collect_solutions` gathers a learner's functions from their notebooks so the
capstone can run the engine with all of them at once.
"""

from __future__ import annotations

import contextlib
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
    return {e.seam: _import_cell(e, _modules_folder()) for e in found if e.started}


_MODULES: list[tempfile.TemporaryDirectory] = []  # (a list, made once: no module name is rebound after import)


def _modules_folder() -> Path:
    """A fresh folder for one collection's module files, inside one temporary directory per process. The files
    stay while the process runs (tracebacks and Triton read a function's source from them); TemporaryDirectory's
    finalizer removes the directory when the process exits, so collecting leaves nothing in the temp dir."""
    if not _MODULES:
        _MODULES.append(tempfile.TemporaryDirectory(prefix="nanoref-solutions-"))
    return Path(tempfile.mkdtemp(dir=_MODULES[0].name))


# -- building the course ---------------------------------------------------------------------------------------
NBGRADER_CONFIG = """\
# nbgrader configuration of the nanoref course (written by `python -m nanoref.classroom build`)
c = get_config()  # noqa: F821
c.CourseDirectory.course_id = {course_id!r}  # the course folder is the one nbgrader runs in (relocatable)
# a learner's solution region becomes exactly this (nbgrader's default, stated so the tests can rely on it)
c.ClearSolutions.code_stub = {{"python": "# YOUR CODE HERE\\nraise NotImplementedError()"}}
c.Execute.timeout = 600
c.CourseDirectory.ignore = [".ipynb_checkpoints", "*.pyc", "__pycache__", "feedback", {marker!r}]  # not for students
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


ASSIGNMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")  # a folder name of its own: no '.', '..' or '/'
BUILT_MARKER = ".nanoref-build"  # written into every source folder build makes: the only folders it replaces


def _read_notebook(path: Path) -> dict:
    """A notebook file's JSON, or a ClassroomError that says what is wrong with it."""
    try:
        content = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as error:
        raise ClassroomError(f"{path}: cannot be read: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise ClassroomError(f"{path} is not UTF-8 text (byte {error.start}): is it a notebook?") from None
    except (json.JSONDecodeError, RecursionError) as error:
        raise ClassroomError(f"{path} is not a notebook: not valid JSON ({error})") from None
    if not isinstance(content, dict) or not isinstance(content.get("cells"), list):
        raise ClassroomError(f"{path} is not a notebook: it has no list of cells")
    return content


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _check_course_folder(out: Path, source: Path, release: Path, notebooks_dir: Path) -> None:
    """Refuse, before anything is written or deleted, a course folder the build cannot or must not write."""
    for replaced in (source, release):
        if _inside(notebooks_dir.resolve(), replaced):
            raise ClassroomError(
                f"--notebooks {notebooks_dir} lies inside {replaced}, which the build replaces; to regenerate the "
                f"student copies from notebooks edited there, run `nbgrader generate_assignment {source.name} "
                f"--force` in {out}"
            )
    for folder in (out, *out.parents):
        if folder.exists() and not folder.is_dir():
            raise ClassroomError(f"--out {out}: {folder} is a file, not a folder")
    if source.exists() and not (source / BUILT_MARKER).is_file():
        raise ClassroomError(
            f"{source} exists and was not made by `python -m nanoref.classroom build` (it has no {BUILT_MARKER}), "
            "so the build will not replace it: move it away, or pass another --out or --assignment"
        )
    config = out / "nbgrader_config.py"
    if config.exists() and not config.read_text(errors="replace").startswith(NBGRADER_CONFIG.splitlines()[0]):
        raise ClassroomError(f"{config} is not the one the build writes; move it away or pass another --out")


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
    Everything is checked (names, paths, every notebook read) before anything is written; a rebuild replaces only
    source/<assignment> (when an earlier build made it) and nbgrader's release/<assignment>.
    """
    notebooks_dir, out = Path(notebooks_dir), Path(out).resolve()
    if not ASSIGNMENT_NAME.fullmatch(assignment):
        raise ClassroomError(
            f"assignment name {assignment!r}: use letters, digits, '_' and '-', starting with a letter or digit"
        )
    if not notebooks_dir.is_dir():
        raise ClassroomError(f"no notebooks folder at {notebooks_dir} (build runs from a nanoref source checkout)")
    notebooks = sorted(notebooks_dir.glob("[0-9]*.ipynb"))
    if select:
        chosen = [nb for nb in notebooks if any(nb.name == s or nb.name.startswith(s) for s in select)]
        missing = [s for s in select if not any(nb.name == s or nb.name.startswith(s) for nb in notebooks)]
        if missing:
            raise ClassroomError(f"no notebook matches {', '.join(missing)} in {notebooks_dir}")
        notebooks = chosen
    source, release = out / "source" / assignment, out / "release" / assignment
    _check_course_folder(out, source, release, notebooks_dir)
    contents = {notebook.name: _self_contained(_read_notebook(notebook)) for notebook in notebooks}
    root = notebooks_dir.resolve().parent
    try:
        if source.exists():
            shutil.rmtree(source)
        source.mkdir(parents=True)
        (source / BUILT_MARKER).write_text("made by `python -m nanoref.classroom build`; a rebuild replaces it\n")
        (out / "nbgrader_config.py").write_text(NBGRADER_CONFIG.format(course_id=COURSE_ID, marker=BUILT_MARKER))
        for name, content in contents.items():
            (source / name).write_text(json.dumps(content, indent=1, ensure_ascii=False) + "\n")
        for folder in SUPPORT_FOLDERS:
            if (root / folder).is_dir():
                shutil.copytree(root / folder, source / folder)
    except OSError as error:
        where = f": {error.filename}" if error.filename else ""
        raise ClassroomError(f"cannot write the course in {out}: {error.strerror or error}{where}") from None
    run_nbgrader(["generate_assignment", assignment, "--force", "--log-level=WARN"], out)
    return sorted(release.glob("*.ipynb"))


# -- a learner's check -----------------------------------------------------------------------------------------
@dataclass
class CellResult:
    grade_id: str
    points: float
    passed: bool
    message: str  # the error's last line when it failed


def _graded_cells(cells: list) -> list[tuple[int, dict]]:
    return [(i, c) for i, c in enumerate(cells) if c.get("cell_type") == "code" and _nbgrader(c).get("grade")]


def expected_grade_ids(notebook: Path) -> dict[str, float]:
    """{grade_id: points} of the course notebook of this name (its reference in notebooks/), else {} (not one of
    the course's, or no source checkout here)."""
    reference = NOTEBOOKS_DIR / notebook.name
    if not reference.is_file():
        return {}
    cells = _read_notebook(reference)["cells"]
    return {str(_nbgrader(c).get("grade_id")): float(_nbgrader(c).get("points", 0)) for _, c in _graded_cells(cells)}


@contextlib.contextmanager
def _quiet_nbformat() -> Iterator[None]:
    import logging

    logger = logging.getLogger("traitlets")  # nbformat's get_logger() outside an application
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def check(notebook: str | Path, *, timeout: int = 600) -> list[CellResult]:
    """Run `notebook` top to bottom in its own folder (its file is left untouched) and report each graded cell.

    A graded cell that fails, times out, or never ran (an earlier cell timed out or killed the kernel) fails; so
    does every graded cell of the course's notebook of this name that is missing from this one. A file that is not
    a valid notebook, or a notebook with nothing to grade, is a ClassroomError.
    """
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    notebook = Path(notebook)
    content = _read_notebook(notebook)
    try:
        with _quiet_nbformat():  # reads logs a schema error and carries on: validate below raises it
            nb = nbformat.reads(json.dumps(content), as_version=4)
        nbformat.validate(nb)
    except (nbformat.ValidationError, ValueError, KeyError, TypeError) as error:
        message = getattr(error, "message", None) or str(error)
        raise ClassroomError(f"{notebook} is not a valid notebook: {message.splitlines()[0]}") from None
    expected = expected_grade_ids(notebook)
    graded = _graded_cells(nb.cells)
    if not graded and not expected:
        raise ClassroomError(f"{notebook} has no graded cells: nothing to check")
    running: list[int] = []  # the index of the cell being run (nbclient's hook), to name one that never finished
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        allow_errors=True,
        resources={"metadata": {"path": str(notebook.resolve().parent)}},
        on_cell_start=lambda cell, cell_index: running.append(cell_index),
    )
    stopped, why = len(nb.cells), ""
    try:
        client.execute()
    except CellTimeoutError:
        stopped, why = running[-1], f"did not finish within --timeout {timeout} s"
    except DeadKernelError:
        stopped, why = running[-1], "the kernel died while it ran (a crash, or the process exited)"
    results = []
    for index, cell in graded:
        meta = _nbgrader(cell)
        grade_id, points = str(meta.get("grade_id")), float(meta.get("points", 0))
        if index >= stopped:
            message = why if index == stopped else f"not run: cell {stopped + 1} before it {why}"
            results.append(CellResult(grade_id, points, False, message))
            continue
        errors = [out for out in cell.get("outputs", []) if out.get("output_type") == "error"]
        message = ""
        if errors:
            error = errors[0]
            message = f"{error['ename']}: {error['evalue']}".strip()
            if error["ename"] == "NotImplementedError":
                message = "not written yet (NotImplementedError): fill in the solution cell above it"
        results.append(CellResult(grade_id, points, not errors, message))
    present = {result.grade_id for result in results}
    for grade_id, points in expected.items():
        if grade_id not in present:
            message = f"missing: the course's {notebook.name} has this graded cell; restore it from the student copy"
            results.append(CellResult(grade_id, points, False, message))
    return results


def _report(notebook: Path, results: list[CellResult]) -> int:
    for result in results:
        verdict = "pass" if result.passed else "FAIL"
        print(f"{verdict}  {result.grade_id} ({result.points:g} points)" + ("" if result.passed else ":"))
        if not result.passed:
            print(textwrap.indent(textwrap.fill(result.message, 110), "      "))
    score = sum(r.points for r in results if r.passed)
    total = sum(r.points for r in results)
    print(f"{notebook.name}: {score:g} / {total:g} points")
    return 0 if all(r.passed for r in results) else 1
