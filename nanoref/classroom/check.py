"""A learner's check of their own copy (each graded cell, as nbgrader grades it) and the capstone's runs,
one line per engine run."""

from __future__ import annotations

import atexit
import contextlib
import json
import tempfile
import textwrap
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from nanoref.classroom.common import NOTEBOOKS_DIR, ClassroomError, _read_notebook
from nanoref.classroom.solutions import _exercise, _nbgrader, _source


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

    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 1:  # (nbclient: 0 or less, no limit)
        raise ClassroomError(f"timeout must be a whole number of seconds >= 1, got {timeout!r}")

    running: list[int] = []  # the index of the cell being run (nbclient's hook), to name one that never finished
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        allow_errors=allow_errors,
        resources={"metadata": {"path": str(notebook.resolve().parent)}},
        on_cell_start=lambda cell, cell_index: running.append(cell_index),
    )
    # the kernel process's own log goes to a file: its noise (a ZMQ traceback as a timed-out cell is stopped, a TCP
    # warning every run) stays out of the learner's terminal, and its last lines say why a kernel died or never
    # started (every cell's output reaches the report through the notebook's messages)
    with tempfile.TemporaryFile() as kernel_log:
        try:
            client.execute(stderr=kernel_log)
        except CellTimeoutError:
            return running[-1], f"did not finish within --timeout {timeout} s"
        except DeadKernelError:
            died = "the kernel died while it ran (a crash, or the process exited)"
            return running[-1], died + _last_words(kernel_log)
        except CellExecutionError as error:
            return running[-1], f"{error.ename}: {error.evalue}".strip()
        except RuntimeError as error:  # ("Kernel died before replying to kernel_info": it never started)
            # nbclient leaves its exit-time cleanup of the kernel that never was registered: it would fail at exit
            atexit.unregister(client._cleanup_kernel)
            raise ClassroomError(f"the notebook's kernel did not start ({error})" + _last_words(kernel_log)) from None
    return len(nb.cells), ""


def _last_words(kernel_log) -> str:
    """The last lines the kernel process wrote to its stderr (its traceback, a missing module), for a message."""
    kernel_log.seek(0)
    lines = [line for line in kernel_log.read().decode("utf-8", "replace").splitlines() if line.strip()]
    lines = [line for line in lines if "running over TCP without encryption" not in line]
    return "; the kernel's last words: " + " | ".join(lines[-3:]) if lines else ""


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
