"""python -m nanoref.classroom {build,check}: see nanoref/classroom/ (build.py, check.py) and docs/teaching.md."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nanoref.classroom import COURSE_ID, NOTEBOOKS_DIR, ClassroomError, build, run_check


def positive_seconds(text: str) -> int:
    """--timeout's value: a whole number of seconds >= 1 (nbclient reads 0 or less as no limit at all)."""
    try:
        seconds = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number of seconds: {text!r}") from None
    if seconds < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 second, got {seconds}")
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanoref.classroom", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser("build", help="lay out an nbgrader course and generate the student copies")
    build_parser.add_argument("--out", required=True, type=Path, help="the course folder to write")
    build_parser.add_argument("--notebooks", type=Path, default=NOTEBOOKS_DIR, help="where the reference notebooks are")
    build_parser.add_argument("--assignment", default=COURSE_ID, help=f"the assignment's name (default {COURSE_ID})")
    build_parser.add_argument("--only", nargs="+", metavar="NAME", help="only these notebooks (names or prefixes)")
    check_parser = commands.add_parser(
        "check", help="run a notebook and report each graded cell (the capstone: each engine run)"
    )
    check_parser.add_argument("notebook", type=Path)
    check_parser.add_argument(
        "--timeout", type=positive_seconds, default=600, help="seconds a cell may run before it fails (default 600)"
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            students = build(args.out, notebooks_dir=args.notebooks, assignment=args.assignment, select=args.only)
            print(
                f"course in {args.out}: {len(students)} student notebooks in {args.out / 'release' / args.assignment}"
            )
            for path in students:
                print(f"  {path.name}")
            return 0
        return run_check(args.notebook, timeout=args.timeout)
    except ClassroomError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
