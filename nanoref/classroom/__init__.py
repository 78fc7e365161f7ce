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

from nanoref.classroom.build import build, run_nbgrader
from nanoref.classroom.check import (
    CellResult,
    RunResult,
    Runs,
    _report,  # noqa: F401  (the report a check prints: its tests read it)
    check,
    check_capstone,
    is_capstone,
    run_check,
)
from nanoref.classroom.common import COURSE_ID, NOTEBOOKS_DIR, REPO_ROOT, UNSTARTED, ClassroomError
from nanoref.classroom.solutions import Exercise, collect_solutions, exercises, own_module

__all__ = [
    "COURSE_ID",
    "NOTEBOOKS_DIR",
    "REPO_ROOT",
    "UNSTARTED",
    "CellResult",
    "ClassroomError",
    "Exercise",
    "RunResult",
    "Runs",
    "build",
    "check",
    "check_capstone",
    "collect_solutions",
    "exercises",
    "is_capstone",
    "own_module",
    "run_check",
    "run_nbgrader",
]
