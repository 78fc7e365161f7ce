"""Student copies made by nbgrader: no solution line survives, a copy stops at its first exercise, nbgrader's
autograde gives the reference notebooks full marks; the learner's check and the capstone's collector."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# the classroom's optional packages (the `classroom` extra): without one, the file skips and says which
for package in ("nbformat", "nbclient", "nbgrader"):
    pytest.importorskip(package, reason=f"{package} is not installed (pip install 'nanoref[classroom]')")

import nbformat  # noqa: E402
from nbclient import NotebookClient  # noqa: E402
from nbclient.exceptions import CellExecutionError  # noqa: E402

from nanoref.classroom import (  # noqa: E402
    NOTEBOOKS_DIR,
    REPO_ROOT,
    ClassroomError,
    RunResult,
    build,
    check,
    check_capstone,
    collect_solutions,
    exercises,
    run_nbgrader,
)
from nanoref.layers.activation import silu_and_mul  # noqa: E402
from nanoref.testing import missing_packages  # noqa: E402

pytestmark = pytest.mark.slow

AUTOGRADED = "07_model_and_sampling.ipynb"  # the autograde test's notebook (nbgrader executes it: ~20 s)


@pytest.fixture(scope="module")
def course(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("course")
    build(out)
    return out


def source_lines(cell) -> list[str]:
    source = cell["source"]
    return (source if isinstance(source, str) else "".join(source)).splitlines()


def regions(notebook: dict, begin: str, end: str) -> tuple[set[str], set[str]]:
    """(lines inside begin/end regions, lines elsewhere in the notebook), stripped, blank lines left out."""
    inside, outside = set(), set()
    for cell in notebook["cells"]:
        within = False
        for line in source_lines(cell):
            text = line.strip()
            if text == begin:
                within = True
            elif text == end:
                within = False
            elif text:
                (inside if within else outside).add(text)
    return inside, outside


def reference_notebooks() -> list[Path]:
    return sorted(NOTEBOOKS_DIR.glob("[0-9]*.ipynb"))


def with_exercises() -> list[Path]:
    return [nb for nb in reference_notebooks() if any(exercises(nb))]


def test_every_notebook_gets_a_student_copy(course):
    released = sorted(p.name for p in (course / "release" / "nanoref").glob("*.ipynb"))
    assert released == [p.name for p in reference_notebooks()]
    assert (course / "release" / "nanoref" / "figures").is_dir()


@pytest.mark.parametrize("notebook", with_exercises(), ids=lambda p: p.stem)
def test_no_solution_line_survives(course, notebook):
    reference = json.loads(notebook.read_text())
    student = json.loads((course / "release" / "nanoref" / notebook.name).read_text())
    student_text = {line.strip() for cell in student["cells"] for line in source_lines(cell)}
    for begin, end in [("### BEGIN SOLUTION", "### END SOLUTION"), ("### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS")]:
        secret, public = regions(reference, begin, end)
        leaked = sorted((secret - public) & student_text)
        assert not leaked, f"{notebook.name}: lines from {begin} regions in the student copy: {leaked[:3]}"
    solution_cells = [c for c in student["cells"] if c["metadata"].get("nbgrader", {}).get("solution")]
    assert solution_cells and all("raise NotImplementedError()" in "".join(source_lines(c)) for c in solution_cells)


@pytest.mark.parametrize("notebook", with_exercises(), ids=lambda p: p.stem)
def test_student_copy_stops_at_its_first_exercise(course, notebook):
    if missing := missing_packages(notebook.stem):
        pytest.skip(f"{notebook.name} needs {', '.join(missing)}, not installed here")
    folder = course / "release" / "nanoref"
    nb = nbformat.read(folder / notebook.name, as_version=4)
    first_test = next(i for i, c in enumerate(nb.cells) if c.metadata.get("nbgrader", {}).get("grade"))
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(folder)}})
    with pytest.raises(CellExecutionError) as failure:
        client.execute()
    assert failure.value.ename == "NotImplementedError"
    ran = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.get("execution_count")]
    assert max(ran) == first_test, f"stopped at cell {max(ran)}, its first exercise's test is cell {first_test}"


def test_autograde_gives_the_reference_full_marks(course):
    from nbgrader.api import Gradebook

    submitted = course / "submitted" / "reference" / "nanoref"
    submitted.mkdir(parents=True)
    shutil.copy(course / "source" / "nanoref" / AUTOGRADED, submitted / AUTOGRADED)
    for folder in ("figures", "benchmarks"):
        shutil.copytree(course / "source" / "nanoref" / folder, submitted / folder)
    run_nbgrader(["autograde", "nanoref", "--create", "--force", "--student=reference"], course)
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        graded = gradebook.find_submission_notebook(Path(AUTOGRADED).stem, "nanoref", "reference")
        assert graded.max_score > 0
        assert graded.score == graded.max_score, f"{graded.score} of {graded.max_score} points"


def test_collect_solutions_from_the_reference_notebooks():
    functions = collect_solutions(NOTEBOOKS_DIR)
    assert {"apply_rotary", "silu_and_mul", "apply_top_k_top_p"} <= set(functions)
    x = torch.randn(5, 12)
    assert torch.equal(functions["silu_and_mul"](x), silu_and_mul(x))
    assert functions["silu_and_mul"].__module__ != "nanoref.layers.activation"  # the cell's own function


def test_collecting_solutions_leaves_nothing_in_the_temp_dir(tmp_path):
    """The module files of the learner's cells live as long as the process (tracebacks and Triton read them), then
    go: collecting every notebook's exercises leaves no nanoref-solutions-* folder behind."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    script = (
        "from nanoref.classroom import NOTEBOOKS_DIR, collect_solutions\n"
        "functions = collect_solutions(NOTEBOOKS_DIR)\n"
        "import inspect; assert 'def silu_and_mul' in inspect.getsource(functions['silu_and_mul'])\n"
    )
    env = {**os.environ, "TMPDIR": str(temp)}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert [p.name for p in temp.iterdir() if p.name.startswith("nanoref")] == []


def test_collect_solutions_names_unstarted_exercises(course):
    folder = course / "release" / "nanoref"
    with pytest.raises(ClassroomError, match="not written yet.*`apply_rotary` \\(07_model_and_sampling.ipynb\\)"):
        collect_solutions(folder)
    assert collect_solutions(folder, allow_unstarted=True) == {}


def exercise_notebook(path: Path, body: str) -> Path:
    nb = nbformat.v4.new_notebook()
    solution = nbformat.v4.new_code_cell(f"import torch\n\n\ndef silu_and_mul(x):\n    {body}\n")
    solution.metadata["nbgrader"] = dict(
        solution=True, grade=False, locked=False, grade_id="ex_silu_and_mul", schema_version=3, task=False
    )
    test = nbformat.v4.new_code_cell(
        "from nanoref.exercises import check_silu_and_mul\n\ncheck_silu_and_mul(silu_and_mul, engine=False)"
    )
    test.metadata["nbgrader"] = dict(
        solution=False, grade=True, locked=True, grade_id="ex_silu_and_mul_test", points=2, schema_version=3, task=False
    )
    nb.cells = [solution, test]
    nbformat.write(nb, path)
    return path


def leaning_on_another_cell(path: Path) -> Path:
    """A right silu_and_mul whose `F` comes from the notebook's setup cell, not from its own cell."""
    path = exercise_notebook(path, "gate, up = x.chunk(2, dim=-1)\n    return F.silu(gate) * up")
    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell("import torch.nn.functional as F"))
    nbformat.write(nb, path)
    return path


ANOTHER_CELL = (
    "your `silu_and_mul` uses `F`, defined in another cell: an answer must import or define everything it uses"
)


def test_check_fails_an_answer_that_uses_a_name_from_another_cell(tmp_path):
    """In the notebook's kernel the answer works (F is there); the capstone imports its cell alone, where it would
    fail deep in the engine. check grades it as the capstone runs it, and says why."""
    [result] = check(leaning_on_another_cell(tmp_path / "mine.ipynb"))
    assert not result.passed
    assert ANOTHER_CELL in result.message, result.message


def test_collect_solutions_names_a_name_from_another_cell(tmp_path):
    leaning_on_another_cell(tmp_path / "mine.ipynb")
    with pytest.raises(ClassroomError, match=f"mine.ipynb, exercise `silu_and_mul`: {ANOTHER_CELL}"):
        collect_solutions(tmp_path)


@pytest.mark.parametrize(
    "cell, function",
    [
        (
            "@torch.no_grad()\ndef silu_and_mul(x):\n    return F.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1]\n",
            "silu_and_mul",
        ),
        (
            "import functools\n\n\n@functools.lru_cache\ndef act():\n    return F.silu\n\n\n"
            "def silu_and_mul(x):\n    return act()(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1]\n",
            "act",
        ),
        (
            "class Act:\n    @staticmethod\n    def of(gate):\n        return F.silu(gate)\n\n\n"
            "def silu_and_mul(x):\n    return Act.of(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1]\n",
            "of",
        ),
    ],
    ids=["no_grad", "lru_cache", "staticmethod"],
)
def test_collect_solutions_names_a_name_from_another_cell_behind_a_decorator_or_in_a_class(tmp_path, cell, function):
    """A decorated function's wrapper is not the learner's code, and a class's methods are not at the cell's top:
    the names they read were not looked at, and the capstone failed deep in the engine with a bare NameError."""
    nb = nbformat.v4.new_notebook()
    solution = nbformat.v4.new_code_cell("import torch\n\n\n" + cell)
    solution.metadata["nbgrader"] = dict(
        solution=True, grade=False, locked=False, grade_id="ex_silu_and_mul", schema_version=3, task=False
    )
    nb.cells = [nbformat.v4.new_code_cell("import torch.nn.functional as F"), solution]
    nbformat.write(nb, tmp_path / "mine.ipynb")
    with pytest.raises(ClassroomError, match=f"your `{function}` uses `F`, defined in another cell"):
        collect_solutions(tmp_path)


def test_collect_solutions_names_a_name_nothing_defines(tmp_path):
    exercise_notebook(tmp_path / "typo.ipynb", "return torch.nn.functional.silu(gaet) * x")
    with pytest.raises(ClassroomError, match="your `silu_and_mul` uses `gaet`, which nothing defines"):
        collect_solutions(tmp_path)


@pytest.mark.parametrize("broken", ["syntax", "deleted"])
def test_an_answer_that_never_ran_gets_no_points_behind_nanorefs_import(tmp_path, broken):
    """Notebook 02 teaches with nanoref's rms_norm under the exercise's name: an answer cell that fails (or was
    deleted) left the test checking nanoref's own, full marks under nbgrader. The test now fails, saying so."""
    path = exercise_notebook(tmp_path / "mine.ipynb", "gate, up = x.chunk(2, dim=-1)\n    return (gate")
    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell("from nanoref.layers.activation import silu_and_mul"))
    if broken == "deleted":
        del nb.cells[1]
    nbformat.write(nb, path)
    results = check(path)
    assert results and not any(result.passed for result in results), [r.message for r in results]
    if broken == "deleted":  # (the syntax error is reported as it is: the check never ran)
        assert "silu_and_mul here is nanoref's own" in results[-1].message, results[-1].message


def test_an_answer_that_leaves_the_stub_after_its_return_is_written(tmp_path):
    """nbgrader's `raise NotImplementedError()` left below the learner's own return never runs: the answer is
    written, for check and for the capstone alike."""
    body = (
        "gate, up = x.chunk(2, dim=-1)\n    return torch.nn.functional.silu(gate) * up\n    raise NotImplementedError()"
    )
    path = exercise_notebook(tmp_path / "mine.ipynb", body)
    [result] = check(path)
    assert result.passed, result.message
    assert set(collect_solutions(tmp_path)) == {"silu_and_mul"}


def test_check_reports_each_graded_cell(tmp_path):
    right = exercise_notebook(
        tmp_path / "right.ipynb", "gate, up = x.chunk(2, dim=-1)\n    return torch.nn.functional.silu(gate) * up"
    )
    [result] = check(right)
    assert result.passed and result.points == 2
    wrong = exercise_notebook(
        tmp_path / "wrong.ipynb", "gate, up = x.chunk(2, dim=-1)\n    return torch.nn.functional.silu(up) * gate"
    )
    cli = subprocess.run(
        [sys.executable, "-m", "nanoref.classroom", "check", str(wrong)], capture_output=True, text=True, timeout=300
    )
    assert cli.returncode == 1
    assert "FAIL  ex_silu_and_mul_test (2 points)" in cli.stdout
    assert "the first half of x is the gate" in cli.stdout
    assert "0 / 2 points" in cli.stdout


def test_student_capstone_names_the_exercises_left_to_write(course):
    folder = course / "release" / "nanoref"
    nb = nbformat.read(folder / "10_capstone.ipynb", as_version=4)
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(folder)}})
    with pytest.raises(CellExecutionError) as failure:
        client.execute()
    assert failure.value.ename == "ClassroomError"
    for seam in ("apply_rotary", "silu_and_mul", "apply_top_k_top_p"):
        assert f"`{seam}` (07_model_and_sampling.ipynb)" in failure.value.evalue


def test_collect_solutions_names_a_broken_cell_and_an_unknown_seam(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    exercise_notebook(broken / "a.ipynb", "return x +")
    with pytest.raises(
        ClassroomError, match="a.ipynb, exercise `silu_and_mul`: its cell fails on its own with SyntaxError"
    ) as raised:
        collect_solutions(broken)
    assert "must import what it needs" not in str(raised.value), "an import hint for a syntax error misleads"
    importing = tmp_path / "importing"
    importing.mkdir()
    nb = nbformat.read(exercise_notebook(importing / "c.ipynb", "return x"), as_version=4)
    nb.cells[0].source = "from torch.nn.functional import no_such_function\n" + nb.cells[0].source
    nbformat.write(nb, importing / "c.ipynb")
    with pytest.raises(ClassroomError, match="ImportError.*a solution cell must import what it needs at its top"):
        collect_solutions(importing)
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    nb = nbformat.read(exercise_notebook(unknown / "b.ipynb", "return x"), as_version=4)
    nb.cells[0].metadata["nbgrader"]["grade_id"] = "ex_silu_and_multiply"
    nbformat.write(nb, unknown / "b.ipynb")
    with pytest.raises(ClassroomError, match="no matching seam.*silu_and_multiply \\(b.ipynb\\)"):
        collect_solutions(unknown)


# -- build: every path and name checked before anything is deleted -----------------------------------------------
def classroom(*args: str) -> tuple[int, str]:
    """`python -m nanoref.classroom ...` in this process: (exit status, stderr)."""
    import contextlib
    import io

    from nanoref.classroom.__main__ import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = main(list(args))
    return status, err.getvalue()


def assert_one_error_line(status: int, err: str, *fragments: str) -> None:
    assert status == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err


def test_an_assignment_name_that_leaves_source_deletes_nothing(tmp_path):
    (tmp_path / "grades.csv").write_text("alice,10\n")
    status, err = classroom("build", "--out", str(tmp_path), "--assignment", "..", "--only", "00")
    assert_one_error_line(status, err, "assignment name '..'")
    assert (tmp_path / "grades.csv").read_text() == "alice,10\n"


def test_a_rebuild_from_the_source_folder_it_replaces_is_refused(tmp_path):
    build(tmp_path, select=["00"])
    edited = tmp_path / "source" / "nanoref" / "00_tour.ipynb"
    status, err = classroom("build", "--out", str(tmp_path), "--notebooks", str(edited.parent))
    assert_one_error_line(status, err, "lies inside", "nbgrader generate_assignment nanoref --force")
    assert edited.is_file()


def test_a_source_folder_the_build_did_not_make_is_not_replaced(tmp_path):
    mine = tmp_path / "source" / "nanoref" / "my_notes.md"
    mine.parent.mkdir(parents=True)
    mine.write_text("keep me")
    status, err = classroom("build", "--out", str(tmp_path), "--only", "00")
    assert_one_error_line(status, err, "was not made by", ".nanoref-build")
    assert mine.read_text() == "keep me"


def test_a_rebuild_replaces_what_the_build_made(tmp_path):
    build(tmp_path, select=["00"])
    (tmp_path / "grades.csv").write_text("alice,10\n")  # the course's other files stay
    assert [p.name for p in build(tmp_path, select=["01"])] == ["01_varlen_flattening.ipynb"]
    assert sorted(p.name for p in (tmp_path / "source" / "nanoref").glob("*.ipynb")) == ["01_varlen_flattening.ipynb"]
    assert (tmp_path / "grades.csv").read_text() == "alice,10\n"
    released = tmp_path / "release" / "nanoref"
    # the build marks the release folder too, listing what it holds; nbgrader's exchange leaves the marker out
    assert "01_varlen_flattening.ipynb" in (released / ".nanoref-build").read_text().splitlines()
    assert "'.nanoref-build'" in (tmp_path / "nbgrader_config.py").read_text().split("c.CourseDirectory.ignore")[1]


def test_a_release_folder_the_build_did_not_make_is_not_replaced(tmp_path):
    mine = tmp_path / "release" / "nanoref" / "my_answers.ipynb"
    mine.parent.mkdir(parents=True)
    mine.write_text("keep me")
    status, err = classroom("build", "--out", str(tmp_path), "--only", "00")
    assert_one_error_line(status, err, str(mine.parent), "was not made by", ".nanoref-build")
    assert mine.read_text() == "keep me"
    assert not (tmp_path / "source").exists(), "refused before anything was written"


@pytest.mark.parametrize("folder", ["release", "source"])
def test_a_users_file_in_a_folder_the_build_made_survives_a_rebuild(tmp_path, folder):
    build(tmp_path, select=["00"])
    mine = tmp_path / folder / "nanoref" / "notes" / "mine.md"
    mine.parent.mkdir()
    mine.write_text("keep me")
    status, err = classroom("build", "--out", str(tmp_path), "--only", "00")
    assert_one_error_line(status, err, str(mine.parents[1]), "holds files the build did not write (notes/mine.md)")
    assert mine.read_text() == "keep me"
    mine.unlink()
    mine.parent.rmdir()
    assert [p.name for p in build(tmp_path, select=["00"])] == ["00_tour.ipynb"]  # without it, a rebuild goes on


def test_check_keeps_each_line_of_a_checks_message(capsys):
    """A check's hint and the case it failed on are lines of their own: the report wraps each, never joins them."""
    from nanoref.classroom import CellResult, _report

    hint = "ExerciseFailure: random text: you returned 'b. ', the one that begins first"
    case = "text='bb. ', stops=['.', 'b. '], start=0: you returned (1, 'b. '), expected (2, '.')"
    _report(Path("11_serving.ipynb"), [CellResult("ex_find_stop_string_test", 2, False, f"{hint}\n{case}")])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:3] == ["      " + hint, "      " + case], lines


def test_build_errors_are_one_line(tmp_path):
    (tmp_path / "a_file").write_text("")
    assert_one_error_line(*classroom("build", "--out", str(tmp_path / "a_file" / "course")), "a_file is a file")
    if sys.platform == "linux":  # a folder nobody may create, even root
        assert_one_error_line(*classroom("build", "--out", "/sys/nanoref-course", "--only", "00"), "cannot write")
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    (notebooks / "01_broken.ipynb").write_text("{not json")
    status, err = classroom("build", "--out", str(tmp_path / "course"), "--notebooks", str(notebooks))
    assert_one_error_line(status, err, "01_broken.ipynb is not a notebook: not valid JSON")


def test_a_kernel_that_does_not_start_is_one_error_with_its_last_words(tmp_path, monkeypatch):
    """The kernel's stderr goes to a file (its noise stays out of the learner's terminal), so where it fails to
    start (no ipykernel in the environment, say) the error carries what it said."""
    spec = tmp_path / "jupyter" / "kernels" / "python3"
    spec.mkdir(parents=True)
    said = "import sys; sys.stderr.write('No module named ipykernel_launcher\\n'); sys.exit(1)"
    (spec / "kernel.json").write_text(
        json.dumps({"argv": [sys.executable, "-c", said], "display_name": "broken", "language": "python"})
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    path = exercise_notebook(tmp_path / "mine.ipynb", "return x")
    with pytest.raises(ClassroomError, match="kernel did not start .*last words: No module named ipykernel_launcher"):
        check(path, timeout=30)


@pytest.mark.parametrize("value", ["0", "-5", "1.5"])
def test_a_timeout_that_is_no_limit_is_refused(value, capsys, tmp_path):
    """nbclient reads a timeout of 0 or less as none at all: a learner's endless loop would never be stopped."""
    from nanoref.classroom.__main__ import main

    with pytest.raises(SystemExit) as exited:
        main(["check", "x.ipynb", "--timeout", value])
    assert exited.value.code == 2 and "argument --timeout:" in capsys.readouterr().err
    with pytest.raises(ClassroomError, match="timeout must be a whole number of seconds >= 1"):  # (the API too)
        check(
            exercise_notebook(tmp_path / "mine.ipynb", "return x"), timeout=float(value) if "." in value else int(value)
        )


# -- check: what it cannot run is named, what is missing fails --------------------------------------------------
@pytest.mark.parametrize(
    "content,message",
    [
        (b"{not json", "is not a notebook: not valid JSON"),
        (b"\xff\xfe{}", "is not UTF-8 text"),
        (b'{"cells": [{"cell_type": "code"}], "nbformat": 4, "nbformat_minor": 5, "metadata": {}}', "not a valid"),
    ],
    ids=["not-json", "not-utf8", "not-nbformat"],
)
def test_check_names_a_file_that_is_not_a_notebook(tmp_path, content, message):
    path = tmp_path / "mine.ipynb"
    path.write_bytes(content)
    assert_one_error_line(*classroom("check", str(path)), message)


def test_a_cell_past_the_timeout_fails_and_the_rest_is_reported_not_run(tmp_path, capfd):
    """... and the kernel's own log (a ZMQ traceback as the stopped cell's reply finds its socket closed, a warning
    about TCP) stays out of the learner's terminal: the report says what happened."""
    path = exercise_notebook(tmp_path / "slow.ipynb", "return x")
    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(1, nbformat.v4.new_code_cell("import time\n\ntime.sleep(60)"))
    nb.cells[1].metadata["nbgrader"] = dict(nb.cells[2].metadata["nbgrader"], grade_id="slow_test")
    nbformat.write(nb, path)
    slow, after = check(path, timeout=2)
    assert (slow.grade_id, slow.passed) == (
        "slow_test",
        False,
    ) and "did not finish within --timeout 2 s" in slow.message
    assert (after.grade_id, after.passed) == ("ex_silu_and_mul_test", False) and after.message.startswith("not run")
    err = capfd.readouterr().err
    assert "Traceback" not in err and "IPKernelApp" not in err, err


def test_a_course_notebook_without_its_graded_cells_fails_naming_them(tmp_path):
    nb = nbformat.read(NOTEBOOKS_DIR / "02_rmsnorm.ipynb", as_version=4)
    nb.cells = [cell for cell in nb.cells if cell.cell_type == "markdown"]  # the graded cells deleted (and the rest)
    nbformat.write(nb, tmp_path / "02_rmsnorm.ipynb")
    results = check(tmp_path / "02_rmsnorm.ipynb")
    assert {r.grade_id for r in results} == {"ex_rms_norm_test", "ex_add_rms_norm_test"}
    assert not any(r.passed for r in results) and all(r.message.startswith("missing") for r in results)
    cli = subprocess.run(
        [sys.executable, "-m", "nanoref.classroom", "check", str(tmp_path / "02_rmsnorm.ipynb")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 1 and "FAIL  ex_rms_norm_test (2 points)" in cli.stdout


# -- a solution cell cannot fake its grade ----------------------------------------------------------------------
FAKE_CHECK = "lambda *args, **kwargs: None"


@pytest.mark.parametrize(
    "replace",
    [
        "nanoref.exercises.check_silu_and_mul = nanoref.exercises.model_and_sampling.check_silu_and_mul = "
        f"{FAKE_CHECK}",
        'vars(nanoref.exercises)["check_silu_and_mul"] = '
        f'vars(nanoref.exercises.model_and_sampling)["check_silu_and_mul"] = {FAKE_CHECK}',
        # the reference the check compares with becomes the identity, which the answer below is
        'vars(nanoref.exercises.model_and_sampling)["silu_and_mul"] = lambda x: x',
    ],
    ids=["setattr", "module-dict", "the-reference"],
)
def test_a_solution_cell_that_replaces_the_check_gets_no_points(tmp_path, replace):
    path = exercise_notebook(tmp_path / "cheat.ipynb", "return x")
    nb = nbformat.read(path, as_version=4)
    cheat = f"import nanoref.exercises\nimport nanoref.exercises.model_and_sampling\n\n{replace}\n\n\n"
    nb.cells[0].source = cheat + nb.cells[0].source
    nbformat.write(nb, path)
    [result] = check(path)
    assert not result.passed, "a cell that replaced the check got the points"
    # the replacing line raised (so silu_and_mul was never defined), or the check found what was replaced
    assert (
        result.message.startswith("NameError")
        or "the check function was replaced" in result.message
        or "its cell fails on its own with AttributeError" in result.message  # graded as the capstone imports it
    ), result.message


# -- the handout --------------------------------------------------------------------------------------------------
def test_student_copies_carry_the_handout(course):
    handout = (course / "release" / "nanoref" / "README.md").read_text()
    for what in (
        "bash .ci/with-venv",  # the repository's environment
        'pip install -e "/path/to/nanoref[classroom]"',  # or one's own, with the classroom extra
        "python -m nanoref.classroom check 07_model_and_sampling.ipynb",
        "python -m nanoref.classroom check 10_capstone.ipynb",
        "An answer must import or define everything it uses",
        "autograde",
    ):
        assert what in handout, what
    # what it names exists
    assert (REPO_ROOT / ".ci" / "with-venv").is_file()
    assert "\nclassroom = [" in (REPO_ROOT / "pyproject.toml").read_text()


# -- the capstone: check runs it, one line per run ------------------------------------------------------------------
def test_check_runs_a_capstone_and_reports_each_run_a_failing_one_included(tmp_path):
    exercise_notebook(
        tmp_path / "01_mine.ipynb", "gate, up = x.chunk(2, dim=-1)\n    return torch.nn.functional.silu(gate) * up"
    )
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "from nanoref.classroom import Runs, collect_solutions\n\nyours = collect_solutions('.')\nruns = Runs()"
        ),
        nbformat.v4.new_code_cell("with runs('first') as run:\n    run.message = f'{len(yours)} collected'"),
        nbformat.v4.new_code_cell(
            "with runs('second'):\n    raise ValueError('broken')\nwith runs('third'):\n    pass"
        ),
        nbformat.v4.new_code_cell("print(runs.verdict())"),
    ]
    nbformat.write(nb, tmp_path / "10_mine.ipynb")
    assert check_capstone(tmp_path / "10_mine.ipynb") == [
        RunResult("first", True, "1 collected"),
        RunResult("second", False, "ValueError: broken"),
        RunResult("third", True, ""),
    ]
    cli = subprocess.run(
        [sys.executable, "-m", "nanoref.classroom", "check", str(tmp_path / "10_mine.ipynb")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 1, cli.stderr
    assert cli.stdout.splitlines() == [
        "pass  first: 1 collected",
        "FAIL  second: ValueError: broken",
        "pass  third",
        "10_mine.ipynb: 2 / 3 runs pass",
    ]


def test_check_of_a_student_capstone_names_the_exercises_left_to_write(course):
    *runs, stopped = check_capstone(course / "release" / "nanoref" / "10_capstone.ipynb")
    assert runs == [] and not stopped.passed and stopped.run == "cell 2", stopped
    from nanoref.utils.seams import SEAMS

    # every exercise seam is one exercise of the course, none written in a student copy
    assert stopped.message.startswith(f"ClassroomError: {len(SEAMS)} exercise(s) not written yet"), stopped.message
    assert stopped.message.endswith("(the cells after it did not run)")


def test_check_runs_the_reference_capstone_one_passing_line_per_run():
    cli = subprocess.run(
        [sys.executable, "-m", "nanoref.classroom", "check", str(NOTEBOOKS_DIR / "10_capstone.ipynb")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert cli.returncode == 0, cli.stdout + cli.stderr
    lines = cli.stdout.splitlines()
    for run in ("torch, ample memory", "torch, under pressure", "Qwen3-MoE, torch, under pressure"):
        assert any(line.startswith(f"pass  {run}: ") for line in lines), (run, lines)
    assert lines[-1] == f"10_capstone.ipynb: {len(lines) - 1} / {len(lines) - 1} runs pass"


def stored_lines(cell) -> list[str]:
    text = []
    for out in cell.get("outputs", []):
        text.append(
            out.get("text", "") if out["output_type"] == "stream" else out.get("data", {}).get("text/plain", "")
        )
    return "".join(line if line.endswith("\n") else line + "\n" for line in text).splitlines()


def test_the_capstone_counts_calls_during_the_pressure_run():
    """The pressure run preempts: the victim choice is called there (nbval keeps these stored outputs current)."""
    nb = nbformat.read(NOTEBOOKS_DIR / "10_capstone.ipynb", as_version=4)
    [cell] = [c for c in nb.cells if c.cell_type == "code" and "under pressure" in c.source and "its calls" in c.source]
    lines = stored_lines(cell)
    pressure = [i for i, line in enumerate(lines) if ", under pressure: " in line and "preemptions" in line]
    assert pressure, lines
    for i in pressure:
        assert " 0 preemptions" not in lines[i]
        calls = dict(item.split(" x") for item in lines[i + 1].removeprefix("  its calls: ").split(", "))
        assert int(calls["choose_preemption_victim"]) > 0, lines[i + 1]


def capstone_section_3(yours: dict) -> list[RunResult]:
    """The capstone's section 3 (text with the built-in model), run as the notebook runs it but with `yours` only:
    its helpers from the cell that defines them (not that cell's engine runs), then the section's own cell."""
    import ast

    nb = nbformat.read(NOTEBOOKS_DIR / "10_capstone.ipynb", as_version=4)
    [helpers] = [c.source for c in nb.cells if c.cell_type == "code" and "def counting(" in c.source]
    [section] = [c.source for c in nb.cells if c.cell_type == "code" and "stop_requests(llm)" in c.source]
    tree = ast.parse(helpers)
    kept = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.Assign, ast.Import, ast.ImportFrom))]
    kept = [node for node in kept if not (isinstance(node, ast.Assign) and "model(" in ast.unparse(node))]
    namespace = {"yours": yours}
    exec(
        "from nanoref import LLM, SamplingParams\nfrom nanoref.classroom import Runs\n"
        "from nanoref.exercises.common import run_with, stream_with\nimport importlib.util\n",
        namespace,
    )
    exec(ast.unparse(ast.Module(body=kept, type_ignores=[])), namespace)
    exec(section, namespace)
    return namespace["runs"].results, namespace["calls"]


def test_the_capstone_compares_text_and_streamed_pieces_and_counts_the_stop_seams():
    from nanoref.engine.detokenizer import find_stop_string, stop_hold_back

    [result], calls = capstone_section_3({"find_stop_string": find_stop_string, "stop_hold_back": stop_hold_back})
    assert result.passed, result
    assert calls["find_stop_string"] > 0 and calls["stop_hold_back"] > 0, calls


def begins_first(text, stops, start):  # the stop string that begins first, not the one that ends first
    found = [(i, s) for s in stops if (i := text.find(s, max(start - len(s) + 1, 0))) >= 0]
    return min(found, key=lambda pair: pair[0]) if found else None


@pytest.mark.parametrize(
    "seam, wrong, what",
    [
        ("find_stop_string", begins_first, "yours ' silently'"),  # the same tokens, another text
        ("stop_hold_back", lambda text, stops: 0, "nanoref streams"),  # the same text, other pieces
    ],
)
def test_the_capstone_fails_notebook_11s_text_level_mistakes(seam, wrong, what):
    [result], _ = capstone_section_3({seam: wrong})
    assert not result.passed and what in result.message, result


def test_the_capstone_ends_with_one_pass_or_fail_line():
    nb = nbformat.read(NOTEBOOKS_DIR / "10_capstone.ipynb", as_version=4)
    last = nb.cells[-1]
    assert last.cell_type == "code"
    [line] = stored_lines(last)
    assert line.startswith("pass  the capstone: all ") and " runs pass" in line, line


def test_check_errors_on_the_capstone_are_one_line(tmp_path):
    broken = tmp_path / "10_capstone.ipynb"
    cells = [{"cell_type": "code", "source": "collect_solutions('.')"}]  # a code cell with no outputs or metadata
    broken.write_text(json.dumps({"cells": cells, "nbformat": 4, "nbformat_minor": 5, "metadata": {}}))
    assert_one_error_line(*classroom("check", str(broken)), "is not a valid notebook")
    assert_one_error_line(*classroom("check", str(tmp_path / "none.ipynb")), "no notebook at")


STUB = "raise NotImplementedError()"


@pytest.mark.parametrize(
    "body, unwritten",
    [
        (f"{STUB}", True),
        (f"return x\n{STUB}", False),
        (f"if x:\n    return 1\n{STUB}", True),  # (x false: the stub runs)
        (f"if x:\n    return 1\nelse:\n    return 2\n{STUB}", False),
        (f"if x:\n    return 1\nelif y:\n    return 2\nelse:\n    raise ValueError(x)\n{STUB}", False),
        (f"if x:\n    return 1\nelif y:\n    return 2\n{STUB}", True),
        (f"if x:\n    return 1\nelse:\n    {STUB}", True),
        (f"with torch.no_grad():\n    return x\n{STUB}", False),
        (f"try:\n    return f(x)\nexcept KeyError:\n    return None\n{STUB}", False),
        (f"try:\n    return f(x)\nexcept KeyError:\n    pass\n{STUB}", True),
        (f"for i in x:\n    continue\n    {STUB}\nreturn x", False),
        (f"for i in x:\n    {STUB}", True),
        ('raise NotImplementedError("no bias yet")', False),
        (f"try:\n    y = f(x)\nexcept KeyError:\n    return None\nelse:\n    return y\n{STUB}", False),
        (f"try:\n    y = f(x)\nexcept KeyError:\n    pass\nelse:\n    return y\n{STUB}", True),
        (f"match x:\n    case 0:\n        return 1\n    case _:\n        return 2\n{STUB}", False),
        (f"match x:\n    case 0:\n        return 1\n    case [*rest] | other:\n        return 2\n{STUB}", False),
        (f"match x:\n    case 0:\n        return 1\n    case 1:\n        return 2\n{STUB}", True),  # (x == 2)
        (f"match x:\n    case 0:\n        return 1\n    case _ if y:\n        return 2\n{STUB}", True),
        (f"while True:\n    x = g(x)\n    if x:\n        return x\n{STUB}", False),
        (f"while True:\n    for i in x:\n        break\n    if y:\n        return x\n{STUB}", False),
        (f"while True:\n    if x:\n        break\n{STUB}", True),
        (f"while x:\n    return x\n{STUB}", True),
        (f"for i in x:\n    if i:\n        return i\nelse:\n    return None\n{STUB}", False),
        (f"for i in x:\n    if i:\n        break\nelse:\n    return None\n{STUB}", True),  # (the break: on to it)
    ],
)
def test_the_stub_counts_as_unwritten_only_where_it_can_run(body, unwritten):
    from nanoref.classroom.solutions import holds_the_stub

    source = "def f(x, y=None):\n" + "".join(f"    {line}\n" for line in body.splitlines())
    assert holds_the_stub(source) is unwritten, source
