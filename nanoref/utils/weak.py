"""A bound method that does not keep its object alive.

A layer hands each of its parameters its weight loader (`param.weight_loader = self.weight_loader`: Nano-vLLM's
pattern, which `load_weights` calls for each checkpoint tensor), and LoRA's manager calls back into the hooks that
own it. A bound method refers to its object, so each of these closes a reference cycle (the layer holds the
parameter, the parameter the layer's method), and a dropped engine's weights would wait for Python's cyclic garbage
collector instead of going with their last reference. `weak_method(self.weight_loader)` is the same call without
that reference.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any


def weak_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` (bound), called through a weak reference to its object; calling it once the object is gone raises
    ReferenceError."""
    ref = weakref.WeakMethod(method)
    name = method.__qualname__  # (not `method` itself: the closure would hold its object)

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        if bound is None:
            raise ReferenceError(f"{name}: its object no longer exists")
        return bound(*args, **kwargs)

    call.__qualname__ = call.__name__ = f"weak_method({name})"
    return call
