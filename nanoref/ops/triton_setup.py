"""Importing Triton the way nanoref needs it: compiled on a GPU, interpreted on a CPU.

Triton compiles kernels for a GPU. Without one, its interpreter runs the same `@triton.jit` code
with NumPy, one program at a time: slow, but every line of the kernel is real and can be stepped
through. The interpreter is switched on by `TRITON_INTERPRET=1`, which must be in the environment
before the `@triton.jit` decorator runs. So every nanoref module that defines a kernel calls
`import_triton()` first, and nanoref never imports those modules until a Triton kernel is asked for.

One more trap: Triton's own library functions (`tl.sum`, `tl.zeros`, ...) are `@triton.jit` functions
too, decorated when `triton.language` is first imported. If something imported Triton before the
switch (transformers' model classes do), those stay compiled-only and an interpreted kernel that calls
them fails with "Cannot call @triton.jit'd outside of the scope of a kernel". `import_triton()` then
re-imports those library modules so that they are decorated for the interpreter too.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import platform
import sys
from types import ModuleType

import torch


class TritonUnavailableError(ImportError):
    """Triton is not installed here (it publishes wheels for Linux only)."""


@functools.cache
def triton_available() -> bool:
    """Whether Triton is installed (looked up once: ~30 us a lookup, and the sampler asks every step on CUDA)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton kernels run under the interpreter (on the CPU) rather than compiled."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernel_device() -> torch.device:
    """Where tensors handed to a nanoref Triton kernel must live: the GPU it compiles for, or the CPU under the
    interpreter. Call after `import_triton()`."""
    return torch.device("cpu") if interpreting() or not torch.cuda.is_available() else torch.device("cuda")


def import_triton() -> ModuleType:
    """`triton`, with the interpreter switched on when there is no GPU to compile for."""
    if not triton_available():
        raise TritonUnavailableError(
            f"Triton is not installed (it ships wheels for Linux only; this is {platform.system()}): "
            "use attention_backend='torch', or `pip install triton` on Linux"
        )
    if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
        os.environ["TRITON_INTERPRET"] = "1"  # must precede every @triton.jit in the process
    imported_before = "triton.language" in sys.modules
    import triton

    if imported_before and interpreting():
        _redecorate_triton_library()
    return triton


def _redecorate_triton_library() -> None:
    """Re-run the `@triton.jit` decorators of Triton's library under the interpreter switch."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(tl.zeros, InterpretedFunction):
        return  # decorated with the switch on already
    for name in ("triton.language.standard", "triton.language.random", "triton.language"):
        importlib.reload(sys.modules[name])  # the package last: it re-exports the reloaded functions
