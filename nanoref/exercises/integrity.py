"""Checks that a learner's cell cannot replace: the graded cells call nanoref's own checking code or fail.

A notebook runs the learner's cells and its graded test cells in one kernel, so a solution cell could rebind
`nanoref.exercises.check_rms_norm` (or a helper a check calls) to a function that accepts anything. `seal` closes
that route for the whole package once every module of it is imported:

- assigning or deleting a name of the package or of one of its modules raises AttributeError, and reading one
  (`from nanoref.exercises import check_rms_norm`, as the graded cells do) always gives the original;
- every check first verifies that no module of the package had a name changed behind that (`vars(module)[name] =`)
  and otherwise fails with an ExerciseFailure that names what was replaced.

What it cannot stop is code that replaces torch, transformers or Python itself: grading in the learner's own
process trusts the process that far.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any


def seal(package: types.ModuleType, failure: type[Exception]) -> None:
    """Freeze `package` and its imported modules as they are now; checks (`check_*`) verify them on every call."""
    prefix = package.__name__ + "."
    modules = [package] + [m for name, m in sorted(sys.modules.items()) if name.startswith(prefix)]
    originals: dict[int, Callable] = {}  # id(check) -> the check, for the wrappers to stand in for it
    for module in modules:
        for name, value in vars(module).items():
            if name.startswith("check_") and isinstance(value, types.FunctionType):
                originals.setdefault(id(value), value)
    # the names as they must stay: dunders excluded (Python itself adds or rebinds some, e.g. __warningregistry__)
    frozen: dict[str, Mapping[str, Any]] = {}

    def intact() -> None:
        for module in modules:
            where = module.__name__
            if sys.modules.get(where) is not module:
                raise failure(f"{where} was replaced in sys.modules: restart the kernel and run the notebook again")
            names = object.__getattribute__(module, "__dict__")
            for name, value in frozen[where].items():
                if names.get(name, intact) is not value:
                    raise failure(
                        f"the check function was replaced: {where}.{name} is no longer nanoref's own, and a check "
                        "can only grade with nanoref's code; restart the kernel and run the notebook again"
                    )

    def guarded(check: Callable) -> Callable:
        @functools.wraps(check)
        def run_check(*args: Any, **kwargs: Any) -> Any:
            intact()
            return check(*args, **kwargs)

        return run_check

    wrappers = {key: guarded(check) for key, check in originals.items()}
    for module in modules:
        names = vars(module)
        for name, value in list(names.items()):
            if id(value) in wrappers and value is originals[id(value)]:
                names[name] = wrappers[id(value)]
        frozen[module.__name__] = types.MappingProxyType(
            {name: value for name, value in names.items() if not (name.startswith("__") and name.endswith("__"))}
        )

    class SealedModule(types.ModuleType):
        def __getattribute__(self, name: str) -> Any:
            sealed = frozen.get(object.__getattribute__(self, "__name__"), {})
            return sealed[name] if name in sealed else super().__getattribute__(name)

        def __setattr__(self, name: str, value: Any) -> None:
            refuse(self, name)
            super().__setattr__(name, value)

        def __delattr__(self, name: str) -> None:
            refuse(self, name)
            super().__delattr__(name)

    def refuse(module: types.ModuleType, name: str) -> None:
        where = object.__getattribute__(module, "__name__")
        if name in frozen.get(where, {}) or name == "__class__":
            raise AttributeError(
                f"{where}.{name} is part of the exercise checks and cannot be replaced: a check grades your function "
                "with nanoref's own code"
            )

    for module in modules:
        module.__class__ = SealedModule
