"""A bound method that does not keep its object alive.

A layer hands each of its parameters its weight loader (`param.weight_loader = self.weight_loader`: Nano-vLLM's
pattern, which `load_weights` calls for each checkpoint tensor), and LoRA's manager calls back into the hooks that
own it. A bound method refers to its object, so each of these closes a reference cycle (the layer holds the
parameter, the parameter the layer's method), and a dropped engine's weights would wait for Python's cyclic garbage
collector instead of going with their last reference. `WeakBoundMethod(self.weight_loader)` is the same call without
that reference; pickled or deep-copied, it is the bound method's (the copy calls the copied layer).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any


class WeakBoundMethod:
    """`method` (bound), called through a weak reference to its object; calling it once the object is gone raises
    ReferenceError."""

    __slots__ = ("_ref", "_name")

    def __init__(self, method: Callable[..., Any]) -> None:
        self._ref = weakref.WeakMethod(method)
        self._name = method.__qualname__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._bound()(*args, **kwargs)

    def _bound(self) -> Callable[..., Any]:
        bound = self._ref()
        if bound is None:
            raise ReferenceError(f"{self._name}: its object no longer exists")
        return bound

    def __reduce__(self) -> tuple:
        return WeakBoundMethod, (self._bound(),)  # (pickle and deepcopy: the method of the copied object)

    def __repr__(self) -> str:
        return f"WeakBoundMethod({self._name})"
