"""A compatibility fix for running these kernels under ``TRITON_INTERPRET=1`` (CPU tests).

Triton 3.6's interpreter passes scalar kernel arguments as one-element NumPy arrays and turns a
loop bound back into a Python int with ``int(array)``, which NumPy 2.x refuses for arrays with a
dimension ("only 0-dimensional arrays can be converted to Python scalars"). Every kernel here
loops up to a runtime length, so we make ``__index__`` take the single element instead. It also
computes ``tl.dot`` of bfloat16 operands on their raw 16-bit patterns (it stores bfloat16 as
``uint16``), so we widen bfloat16 operands to float32 first, which is what the GPU's bf16 matrix
units do with a float32 accumulator. Nothing changes when the interpreter is not in use.
"""

from __future__ import annotations

import os

_patched = False


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def patch_if_interpreting() -> None:
    """Install the ``__index__`` fix into Triton's interpreter once, if it is in use."""
    global _patched
    if _patched or not interpreting():
        return
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:  # a Triton without this hook: nothing to fix
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched

    import numpy as np
    import triton.language as tl

    builder_cls = interpreter.InterpreterBuilder
    original_dot = builder_cls.create_dot

    def widen(handle):
        if handle.dtype.scalar == tl.bfloat16:
            bits = handle.data.astype(np.uint32) << np.uint32(16)
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
        return handle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder_cls.create_dot = create_dot
    _patched = True
