"""The notebooks as a course: student copies made by nbgrader, a learner's own check, and the capstone's collector.

    python -m nanoref.classroom build --out course      # an nbgrader course; student copies in course/release/
    python -m nanoref.classroom check 07_model_and_sampling.ipynb   # does my copy pass? (each graded cell)
    python -m nanoref.classroom check 10_capstone.ipynb             # the capstone: one line per engine run

An exercise is a solution cell whose nbgrader `grade_id` is `ex_<seam>` (a seam of `nanoref.utils.seams.SEAMS`),
followed by a locked, graded test cell. nbgrader's own `generate_assignment` turns every solution region into
`raise NotImplementedError()`; `collect_solutions` gathers a learner's functions from their notebooks so the
capstone can run the engine with all of them at once. Each solution cell runs as a module of its own there (and in
`check`, which grades exactly what the capstone will run), so an answer must import or define everything it uses.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import dis
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import traceback
import types
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


def _exercise(cell: dict, notebook: Path) -> Exercise | None:
    """The exercise a cell holds (a code cell, nbgrader solution, grade_id `ex_<seam>`), else None."""
    meta = _nbgrader(cell)
    grade_id = str(meta.get("grade_id", ""))
    if cell.get("cell_type") != "code" or not meta.get("solution") or not grade_id.startswith("ex_"):
        return None
    source = _source(cell)
    return Exercise(grade_id[3:], notebook, source, started=UNSTARTED not in source)


def exercises(notebook: str | Path) -> Iterator[Exercise]:
    """The exercises of one notebook, in order: solution cells whose grade_id is `ex_<seam>`."""
    notebook = Path(notebook)
    for cell in json.loads(notebook.read_text()).get("cells", []):
        exercise = _exercise(cell, notebook)
        if exercise is not None:
            yield exercise


def _functions_of(module: types.ModuleType) -> Iterator[types.FunctionType]:
    """The functions a module file defines (a @triton.jit kernel keeps its Python function in `.fn`)."""
    for value in vars(module).values():
        function = value if isinstance(value, types.FunctionType) else getattr(value, "fn", None)
        if isinstance(function, types.FunctionType) and function.__module__ == module.__name__:
            yield function


def _globals_read(code: types.CodeType) -> Iterator[str]:
    """The global names a function's code reads, nested functions and lambdas included."""
    for instruction in dis.get_instructions(code):
        if instruction.opname == "LOAD_GLOBAL":
            yield instruction.argval
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _globals_read(constant)


def _names_bound_at_top(source: str) -> set[str]:
    """The names a cell binds in the notebook's namespace (imports, defs, assignments; not inside functions)."""
    code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set()
    names: set[str] = set()
    nodes: list[ast.AST] = list(tree.body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)  # its body binds names of its own scope: not the notebook's
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif not isinstance(node, (ast.Lambda, ast.GeneratorExp, ast.ListComp, ast.SetComp, ast.DictComp)):
            nodes.extend(ast.iter_child_nodes(node))
    return names


def _defined_in_other_cells(exercise: Exercise) -> set[str]:
    cells = _read_notebook(exercise.notebook)["cells"]
    sources = [_source(c) for c in cells if c.get("cell_type") == "code" and _source(c) != exercise.source]
    return set().union(*map(_names_bound_at_top, sources))


def _unbound_names(exercise: Exercise, module: types.ModuleType) -> str:
    """'' when every global name the cell's functions read is the cell's own or a builtin, else what is missing."""
    for function in sorted(_functions_of(module), key=lambda f: f.__name__ != exercise.seam):  # the seam's first
        missing = [n for n in dict.fromkeys(_globals_read(function.__code__)) if n not in vars(module)]
        missing = [name for name in missing if not hasattr(builtins, name)]
        if missing:
            elsewhere = _defined_in_other_cells(exercise)
            uses = "; ".join(
                f"`{name}`, " + ("defined in another cell" if name in elsewhere else "which nothing defines")
                for name in missing
            )
            return f"your `{function.__name__}` uses {uses}"
    return ""


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
    # a name from another cell raises NameError only when the function runs, deep in the engine: found here instead
    unbound = _unbound_names(exercise, module)
    if unbound:
        del sys.modules[module_name]
        raise ClassroomError(
            f"{exercise.notebook.name}, exercise `{exercise.seam}`: {unbound}: an answer must import or define "
            "everything it uses"
        )
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


def own_module(notebook: str | Path, seam: str) -> Callable:
    """The function of exercise `seam` of `notebook`, its cell imported as a module of its own, exactly as
    collect_solutions imports it for the capstone (`check` rebinds each answer to this before its graded cells)."""
    notebook = Path(notebook)
    found = [exercise for exercise in exercises(notebook) if exercise.seam == seam]
    if not found:
        raise ClassroomError(f"{notebook.name} has no exercise `{seam}`")
    return _import_cell(found[0], _modules_folder())


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

# the student README of the release folder (build writes it into the source folder; nbgrader copies it)
HANDOUT = """\
# nanoref: build an LLM inference engine, one piece at a time

Each notebook explains one stage of a Nano-vLLM-style inference engine for Qwen3 with nanoref's real code, then
asks you for one or more of its functions. A solution cell holds `raise NotImplementedError()` until you replace
it; the locked test cell after it checks your function alone on random inputs, then runs the real engine with it
in place and compares every generated token with HF transformers. `10_capstone.ipynb` runs the engine with all of
your functions at once.

## The environment

Either the nanoref repository's own environment (a checkout of it; `.venv` is built on first use):

    bash .ci/with-venv python -m nanoref "Beautiful is better than"    # in the checkout: builds .venv, then runs
    /path/to/nanoref/.venv/bin/jupyter lab                            # in this folder

or an environment of your own with PyTorch and nanoref with its `classroom` extra (nbgrader, nbclient, nbformat):

    pip install -e "/path/to/nanoref[classroom]"

Everything runs on a CPU (the Triton notebooks, 03 and 04, under Triton's interpreter on Linux).

## The rule for every answer

A solution cell is graded, and used by the capstone, on its own: it is imported as a module of its own, without
the notebook's other cells. **An answer must import or define everything it uses**, with its imports at its top
(`import torch`, `from nanoref.ops.attention_torch import gather_paged`, ...), even what an earlier cell imported.

## Checking your work

From this folder, with the environment's Python:

    python -m nanoref.classroom check 07_model_and_sampling.ipynb

runs the notebook top to bottom (the file is not changed) with each answer imported on its own, as the capstone
imports it, and prints every graded cell as `pass` or `FAIL` with the check's message, and your points.
`python -m nanoref.classroom check 10_capstone.ipynb` runs the capstone with all of your answers and prints one
`pass` or `FAIL` line per engine run. (Through the repository's script, give the notebook's full path:
`bash .ci/with-venv python -m nanoref.classroom check "$PWD/07_model_and_sampling.ipynb"`, since it runs from
the checkout.)

## How it is graded

Your instructor collects the notebooks and runs nbgrader's `autograde`: it puts back the locked test cells (and
any hidden tests) as they were handed out, runs each notebook from the top, and gives a graded cell its points
when it runs without an error. The capstone has no points of its own: it runs the engine on all of your answers
together (ample memory and under pressure, on the torch and Triton backends, a Qwen3-MoE and two tensor-parallel
ranks), so an answer that passes its own test but leans on another cell fails there.
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
# written into every folder build makes (source/<assignment>, and release/<assignment> after nbgrader made it for
# the build), with the files it wrote there: the only folders it replaces, and only while they hold nothing else
BUILT_MARKER = ".nanoref-build"
MARKER_HEADER = "made by `python -m nanoref.classroom build`; a rebuild replaces it. The files it wrote:"


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


def _files_in(folder: Path) -> list[str]:
    """Every file under `folder` (not the marker), as paths relative to it, sorted."""
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file() or path.is_symlink()
                  if path.name != BUILT_MARKER or path.parent != folder)  # fmt: skip


def _mark(folder: Path) -> None:
    """Mark `folder` as the build's, listing the files in it now (all the build's: it made the folder)."""
    (folder / BUILT_MARKER).write_text("\n".join([MARKER_HEADER, *_files_in(folder)]) + "\n")


def _check_replaceable(folder: Path) -> None:
    """A ClassroomError unless `folder` is absent, or made by an earlier build and holding only the files it wrote."""
    if not folder.exists() and not folder.is_symlink():
        return
    marker = folder / BUILT_MARKER
    if not folder.is_dir() or folder.is_symlink() or not marker.is_file():
        raise ClassroomError(
            f"{folder} exists and was not made by `python -m nanoref.classroom build` (it has no {BUILT_MARKER}), "
            "so the build will not replace it: move it away, or pass another --out or --assignment"
        )
    header, *written = marker.read_text(errors="replace").splitlines() or [""]
    if header != MARKER_HEADER:
        return  # a build stopped half-way, or an earlier version's marker: no list, the folder is the build's whole
    others = [name for name in _files_in(folder) if name not in set(written)]
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise ClassroomError(
            f"{folder} holds files the build did not write ({shown}), which a rebuild would delete: move them away, "
            "or pass another --out or --assignment"
        )


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
    for replaced in (source, release):
        _check_replaceable(replaced)
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
        # marked at once, as the build's whole (its files are listed at the end): a build stopped half-way is redone
        (source / BUILT_MARKER).write_text("being written by `python -m nanoref.classroom build`\n")
        (out / "nbgrader_config.py").write_text(NBGRADER_CONFIG.format(course_id=COURSE_ID, marker=BUILT_MARKER))
        (source / "README.md").write_text(HANDOUT)
        for name, content in contents.items():
            (source / name).write_text(json.dumps(content, indent=1, ensure_ascii=False) + "\n")
        for folder in SUPPORT_FOLDERS:
            if (root / folder).is_dir():
                shutil.copytree(root / folder, source / folder)
        _mark(source)
    except OSError as error:
        where = f": {error.filename}" if error.filename else ""
        raise ClassroomError(f"cannot write the course in {out}: {error.strerror or error}{where}") from None
    try:
        run_nbgrader(["generate_assignment", assignment, "--force", "--log-level=WARN"], out)
    finally:
        if release.is_dir():  # nbgrader made it for this build (nbgrader's exchange leaves the marker out)
            _mark(release)
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


def _valid_notebook(notebook: Path):
    """The notebook as nbformat's node, or a ClassroomError that says what is wrong with the file."""
    import nbformat

    content = _read_notebook(notebook)
    try:
        with _quiet_nbformat():  # reads logs a schema error and carries on: validate below raises it
            nb = nbformat.reads(json.dumps(content), as_version=4)
        nbformat.validate(nb)
    except (nbformat.ValidationError, ValueError, KeyError, TypeError) as error:
        message = getattr(error, "message", None) or str(error)
        raise ClassroomError(f"{notebook} is not a valid notebook: {message.splitlines()[0]}") from None
    return nb


def _execute(nb, notebook: Path, timeout: int, *, allow_errors: bool) -> tuple[int, str]:
    """Run `nb` in `notebook`'s folder; (the index of the cell it stopped at, why), or (len(cells), '') when every
    cell ran. Without allow_errors, the first cell that raises stops it."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    running: list[int] = []  # the index of the cell being run (nbclient's hook), to name one that never finished
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        allow_errors=allow_errors,
        resources={"metadata": {"path": str(notebook.resolve().parent)}},
        on_cell_start=lambda cell, cell_index: running.append(cell_index),
    )
    try:
        client.execute()
    except CellTimeoutError:
        return running[-1], f"did not finish within --timeout {timeout} s"
    except DeadKernelError:
        return running[-1], "the kernel died while it ran (a crash, or the process exited)"
    except CellExecutionError as error:
        return running[-1], f"{error.ename}: {error.evalue}".strip()
    return len(nb.cells), ""


def _as_the_capstone_runs_it(cells: list, notebook: Path) -> None:
    """Make each graded cell after a written exercise first rebind the answer to its cell imported as a module of
    its own (own_module), so the check grades what the capstone will run: a name the answer takes from another
    cell fails here, not deep in the capstone's engine. Only this in-memory copy changes."""
    seam = None
    for cell in cells:
        exercise = _exercise(cell, notebook)
        if exercise is not None:
            seam = exercise.seam if exercise.started else None
        elif seam and cell.get("cell_type") == "code" and _nbgrader(cell).get("grade"):
            cell["source"] = (
                f"{seam} = __import__('nanoref.classroom', fromlist=['own_module']).own_module("
                f"{str(notebook.resolve())!r}, {seam!r})  # your answer as the capstone runs it\n" + _source(cell)
            )


def check(notebook: str | Path, *, timeout: int = 600) -> list[CellResult]:
    """Run `notebook` top to bottom in its own folder (its file is left untouched) and report each graded cell.

    Each written answer is graded as the capstone runs it: its cell imported as a module of its own. A graded
    cell that fails, times out, or never ran (an earlier cell timed out or killed the kernel) fails; so does every
    graded cell of the course's notebook of this name that is missing from this one. A file that is not a valid
    notebook, or a notebook with nothing to grade, is a ClassroomError.
    """
    notebook = Path(notebook)
    nb = _valid_notebook(notebook)
    expected = expected_grade_ids(notebook)
    graded = _graded_cells(nb.cells)
    if not graded and not expected:
        if is_capstone(notebook):
            raise ClassroomError(f"{notebook} is a capstone, with no graded cells: check_capstone runs it")
        raise ClassroomError(f"{notebook} has no graded cells: nothing to check")
    _as_the_capstone_runs_it(nb.cells, notebook)
    stopped, why = _execute(nb, notebook, timeout, allow_errors=True)
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


# -- the capstone: one line per engine run -----------------------------------------------------------------------
RUN_MIME = "application/vnd.nanoref.capstone-run+json"  # how a run's result travels from the kernel to `check`


@dataclass
class RunResult:
    run: str  # what ran, e.g. "torch, under pressure"
    passed: bool
    message: str  # what it showed, or the error that stopped it

    def line(self) -> str:
        return f"{'pass' if self.passed else 'FAIL'}  {self.run}" + (f": {self.message}" if self.message else "")


class Runs:
    """The capstone's engine runs, each one pass/fail line; a failing run does not stop the notebook.

    runs = Runs()
    with runs("torch, under pressure") as run:
        ...                                  # raises: FAIL with the error (its traceback on stderr)
        run.message = "2 preemptions"        # what a passing run shows
    print(runs.verdict())                    # one line for all of them
    """

    def __init__(self) -> None:
        self.results: list[RunResult] = []

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[RunResult]:
        result = RunResult(name, True, "")
        try:
            yield result
        except Exception as error:  # the next run still runs; the learner gets the whole traceback to read
            traceback.print_exc()
            result.passed, result.message = False, f"{type(error).__name__}: {error}".strip()
        self.results.append(result)
        _show_run(result)

    def verdict(self) -> str:
        failed = [r.run for r in self.results if not r.passed]
        if not self.results:
            return "FAIL  the capstone: no run finished"
        if failed:
            return f"FAIL  the capstone: {len(failed)} of {len(self.results)} runs failed ({'; '.join(failed)})"
        return (
            f"pass  the capstone: all {len(self.results)} runs pass: the engine you have been reading is also one "
            "you have written, and it generates, token for token, what HF transformers generates"
        )


def _show_run(result: RunResult) -> None:
    """The run's line; in a Jupyter kernel also its fields under RUN_MIME, which `check` reads back."""
    from dataclasses import asdict

    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        get_ipython = None
    if get_ipython is None or get_ipython() is None:
        print(result.line())
        return
    display({"text/plain": result.line(), RUN_MIME: asdict(result)}, raw=True)


def is_capstone(notebook: str | Path) -> bool:
    """A capstone collects the folder's solutions and runs the engine on them (notebook 10)."""
    cells = _read_notebook(Path(notebook))["cells"]
    return any(c.get("cell_type") == "code" and "collect_solutions(" in _source(c) for c in cells)


def check_capstone(notebook: str | Path, *, timeout: int = 600) -> list[RunResult]:
    """Run the capstone `notebook` top to bottom in its own folder, with the solutions of that folder, and report
    each engine run. A cell that raises outside a run (collecting the solutions, say) stops it and fails."""
    notebook = Path(notebook)
    nb = _valid_notebook(notebook)
    stopped, why = _execute(nb, notebook, timeout, allow_errors=False)
    results = [
        RunResult(**out["data"][RUN_MIME])
        for cell in nb.cells[:stopped]
        for out in cell.get("outputs", [])
        if out.get("output_type") == "display_data" and RUN_MIME in out.get("data", {})
    ]
    if stopped < len(nb.cells):
        results.append(RunResult(f"cell {stopped + 1}", False, f"{why} (the cells after it did not run)"))
    elif not results:
        results.append(RunResult("the capstone", False, "no run finished"))
    return results


def run_check(notebook: Path, *, timeout: int = 600) -> int:
    """`python -m nanoref.classroom check`: print the report; exit status 0 when everything passes, else 1."""
    if not notebook.is_file():
        raise ClassroomError(f"no notebook at {notebook}")
    if is_capstone(notebook):
        return _report_runs(notebook, check_capstone(notebook, timeout=timeout))
    return _report(notebook, check(notebook, timeout=timeout))


def _report_runs(notebook: Path, results: list[RunResult]) -> int:
    for result in results:
        print(result.line())
    passed = sum(r.passed for r in results)
    print(f"{notebook.name}: {passed} / {len(results)} runs pass")
    return 0 if passed == len(results) else 1


def _wrapped(message: str, width: int = 110) -> str:
    """`message` with each of its lines wrapped to `width` on its own: a check puts its hint and the case it failed
    on lines of their own, and they stay there."""
    return "\n".join(piece for line in message.splitlines() for piece in textwrap.wrap(line, width) or [""])


def _report(notebook: Path, results: list[CellResult]) -> int:
    for result in results:
        verdict = "pass" if result.passed else "FAIL"
        print(f"{verdict}  {result.grade_id} ({result.points:g} points)" + ("" if result.passed else ":"))
        if not result.passed:
            print(textwrap.indent(_wrapped(result.message), "      "))
    score = sum(r.points for r in results if r.passed)
    total = sum(r.points for r in results)
    print(f"{notebook.name}: {score:g} / {total:g} points")
    return 0 if all(r.passed for r in results) else 1
