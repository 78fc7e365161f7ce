"""A learner's exercises read from their notebooks: each solution cell as a module of its own, collected
for the capstone (`collect_solutions`) and run by `check` exactly as the capstone will run it."""

from __future__ import annotations

import ast
import builtins
import dis
import importlib.util
import inspect
import json
import sys
import tempfile
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import cloudpickle

from nanoref.classroom.common import UNSTARTED, ClassroomError, _read_notebook
from nanoref.utils.seams import SEAMS


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
    return Exercise(grade_id[3:], notebook, source, started=not holds_the_stub(source))


def holds_the_stub(source: str) -> bool:
    """Whether a solution cell still holds nbgrader's stub where it would run: a bare `raise NotImplementedError()`
    that nothing before it in its block makes unreachable (a return, a raise, an if/else, with, try or match that
    ends every way, a `while True:` without a break: `_ends`). An answer that leaves the stub after its own return,
    or raises NotImplementedError("...") for a case it does not serve, is written."""
    if UNSTARTED not in source:
        return False
    try:
        tree = ast.parse(_without_magics(source))
    except SyntaxError:  # (not run yet either way: the check reports the SyntaxError)
        return False
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if not isinstance(block, list):
                continue
            for statement in block:
                if _is_stub(statement):
                    return True
                if _ends(statement):
                    break  # (what follows in this block never runs)
    return False


def _ends(statement: ast.stmt) -> bool:
    """Whether control never passes from `statement` to the next one in its block: a return, a raise (but the stub),
    break or continue; an if/else, with, try or match whose every way through ends so; a `while True:`, or a loop
    whose else ends so, without a break of its own."""
    if isinstance(statement, (ast.Return, ast.Break, ast.Continue)):
        return True
    if isinstance(statement, ast.Raise):
        return not _is_stub(statement)
    if isinstance(statement, ast.If):
        return bool(statement.orelse) and _block_ends(statement.body) and _block_ends(statement.orelse)
    if isinstance(statement, (ast.With, ast.AsyncWith)):
        return _block_ends(statement.body)
    if isinstance(statement, ast.Try):  # (its else runs where its body ran to the end)
        tried = _block_ends(statement.body) or _block_ends(statement.orelse)
        handled = tried and all(_block_ends(handler.body) for handler in statement.handlers)
        return handled or _block_ends(statement.finalbody)
    if isinstance(statement, ast.Match):  # every case ends, and the last one takes whatever no other took
        last = statement.cases[-1]
        irrefutable = last.guard is None and _irrefutable(last.pattern)
        return irrefutable and all(_block_ends(case.body) for case in statement.cases)
    if isinstance(statement, (ast.For, ast.AsyncFor, ast.While)):  # left by a break of its own, else by its else
        forever = isinstance(statement, ast.While) and isinstance(statement.test, ast.Constant) and statement.test.value
        ended = forever or _block_ends(statement.orelse)  # (`while True:`, or a for/else whose else ends)
        return bool(ended) and not any(_breaks(one) for one in statement.body)
    return False


def _block_ends(block: list[ast.stmt]) -> bool:
    return any(_ends(statement) for statement in block)


def _irrefutable(pattern: ast.pattern) -> bool:
    """`case _`, `case name` (or either `as` a name, or an `|` with one of them): a pattern that matches anything."""
    if isinstance(pattern, ast.MatchAs):
        return pattern.pattern is None or _irrefutable(pattern.pattern)
    return isinstance(pattern, ast.MatchOr) and any(_irrefutable(one) for one in pattern.patterns)


def _breaks(node: ast.AST) -> bool:
    """Whether a `break` in `node` leaves the loop `node` is in (not one of a loop or function inside it)."""
    if isinstance(node, ast.Break):
        return True
    if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):  # (its else belongs to the outer loop)
        return any(_breaks(one) for one in node.orelse)
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
        return False
    return any(_breaks(child) for child in ast.iter_child_nodes(node))


def _without_magics(source: str) -> str:
    """A cell's code with its IPython lines (`%magic`, `!shell`) blanked, so that Python's parser reads the rest."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def _is_stub(statement: ast.stmt) -> bool:
    """`raise NotImplementedError()` (or without the parentheses), as nbgrader writes it."""
    if not isinstance(statement, ast.Raise) or statement.cause is not None:
        return False
    raised = statement.exc
    if isinstance(raised, ast.Call) and not raised.args and not raised.keywords:
        raised = raised.func
    return isinstance(raised, ast.Name) and raised.id == "NotImplementedError"


def exercises(notebook: str | Path) -> Iterator[Exercise]:
    """The exercises of one notebook, in order: solution cells whose grade_id is `ex_<seam>`."""
    notebook = Path(notebook)
    for cell in json.loads(notebook.read_text()).get("cells", []):
        exercise = _exercise(cell, notebook)
        if exercise is not None:
            yield exercise


def _functions_of(module: types.ModuleType) -> Iterator[types.FunctionType]:
    """The functions a module file's code defines: at its top, under a decorator (@torch.no_grad(), @lru_cache:
    `__wrapped__`; a @triton.jit kernel keeps its Python function in `.fn`) and in its classes (methods, static
    and class methods). A decorator's own wrapper, written elsewhere, is not the file's."""
    values = list(vars(module).values())
    classes = [value for value in values if isinstance(value, type) and value.__module__ == module.__name__]
    values += [member for value in classes for member in vars(value).values()]
    for value in values:
        value = getattr(value, "__func__", value)  # (a staticmethod's or classmethod's function)
        for function in (value, getattr(value, "fn", None), inspect.unwrap(value) if callable(value) else None):
            if isinstance(function, types.FunctionType) and function.__code__.co_filename == module.__file__:
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
    try:
        tree = ast.parse(_without_magics(source))
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
    functions = dict.fromkeys(_functions_of(module))  # (a decorated function comes twice: wrapper, unwrapped)
    for function in sorted(functions, key=lambda f: f.__name__ != exercise.seam):  # the seam's first
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
        # (the hint where a name is missing: a cell run alone lacks what other cells imported)
        hint = (
            " (a solution cell must import what it needs at its top)"
            if isinstance(error, (NameError, ImportError))
            else ""
        )
        raise ClassroomError(
            f"{exercise.notebook.name}, exercise `{exercise.seam}`: its cell fails on its own with "
            f"{type(error).__name__}: {error}{hint}"
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
