"""A compatibility fix for running these kernels under ``TRITON_INTERPRET=1`` (CPU tests).

Triton 3.6's interpreter passes scalar kernel arguments as one-element NumPy arrays and turns a
loop bound back into a Python int with ``int(array)``, which NumPy 2.x refuses for arrays with a
dimension ("only 0-dimensional arrays can be converted to Python scalars"). Every kernel here
loops up to a runtime length, so we make ``__index__`` take the single element instead. It also
computes ``tl.dot`` of bfloat16 operands on their raw 16-bit patterns (it stores bfloat16 as
``uint16``), so we widen bfloat16 operands to float32 first, which is what the GPU's bf16 matrix
units do with a float32 accumulator. And it rounds float32 -> bfloat16 casts toward zero
(``x.to(tl.bfloat16)`` passes no rounding mode, and its converter then truncates the mantissa),
where the GPU rounds to nearest even; we round to nearest even, so a kernel that rounds
intermediate values (the fused MoE kernels round gate/up and each expert's output) is tested
with the GPU's arithmetic. Its elementwise add, subtract and multiply also work on those raw bit
patterns for bfloat16 operands, so we compute them in float32 and round the result to bfloat16
(nearest even), as the GPU's bf16 arithmetic does (the int4 GEMM dequantizes in bf16). Nothing
changes when the interpreter is not in use.
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

    original_cast = builder_cls.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(_float32_to_bfloat16_bits(src.data), tl.bfloat16)
        return original_cast(self, src, dst_type)

    builder_cls.cast_impl = cast_impl

    def bf16_arith(name, op):
        original_op = getattr(builder_cls, name)

        def create(self, lhs, rhs):
            if lhs.dtype.scalar != tl.bfloat16:
                return original_op(self, lhs, rhs)
            out = op(widen(lhs).data, widen(rhs).data).astype(np.float32)
            return interpreter.TensorHandle(_float32_to_bfloat16_bits(out), tl.bfloat16)

        setattr(builder_cls, name, create)

    bf16_arith("create_fadd", np.add)
    bf16_arith("create_fsub", np.subtract)
    bf16_arith("create_fmul", np.multiply)
    _patched = True


def _float32_to_bfloat16_bits(values):
    """bfloat16 bit patterns (uint16) of float32 ``values``, rounded to nearest even (NaNs stay
    NaN)."""
    import numpy as np

    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(
        16
    )
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    rounded = np.where(nan, (bits >> np.uint32(16)) | np.uint32(0x40), rounded)
    return rounded.astype(np.uint16).reshape(np.shape(values))
