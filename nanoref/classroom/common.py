"""What every part of the classroom shares: where the notebooks are, the course's id, its error, and reading a
notebook file."""

from __future__ import annotations

import json
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"  # present in a source checkout (the course material lives there)
COURSE_ID = "nanoref"
UNSTARTED = "raise NotImplementedError"  # what nbgrader leaves in a solution region of a student copy


class ClassroomError(RuntimeError):
    """A course cannot be built, or a learner's exercises cannot be collected; the message says why."""


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
