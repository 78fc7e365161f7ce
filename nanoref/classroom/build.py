"""The course built from the notebooks: nbgrader's configuration, student copies (`generate_assignment`),
the handout, and a build folder that a rebuild may replace but never anything else."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from nanoref.classroom.common import COURSE_ID, NOTEBOOKS_DIR, ClassroomError, _read_notebook
from nanoref.classroom.solutions import _source

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
`pass` or `FAIL` line per engine run. (Through the repository's script, from this folder, give the script's
path in the checkout and the notebook's full path, since the script runs from the checkout:
`bash /path/to/nanoref/.ci/with-venv python -m nanoref.classroom check "$PWD/07_model_and_sampling.ipynb"`.)

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
