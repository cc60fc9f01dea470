"""The faithful interpreter tier: Triton's CPU interpreter (``TRITON_INTERPRET=1``) given a GPU's arithmetic for
``tl.dot`` and for casts to and from bfloat16, so that a Triton kernel checked on CPU CI is checked as it computes on
an NVIDIA GPU (docs/triton.md, "The faithful interpreter tier").

What triton 3.9's interpreter does (``triton/runtime/interpreter.py``, class ``InterpreterBuilder``), and what
:func:`install` makes it do instead, method by method of that class (patched on the class, so the one
``interpreter_builder`` every interpreted kernel goes through sees them; :func:`uninstall` puts the originals back):

* ``create_dot(a, b, acc, input_precision, max_num_imprecise_acc)``: ``np.matmul(a, b, dtype=acc.dtype) + acc``
  on the storage arrays, whatever ``input_precision`` says: float32 operands multiplied in IEEE float32 (a GPU's
  default ``input_precision="tf32"`` keeps 10 explicit mantissa bits), bfloat16 operands multiplied as their
  uint16 storage bits (integers). Patched (float32 accumulator): float32 operands

  - ``"ieee"``: unchanged, IEEE float32 products and float32 sums;
  - ``"tf32"``: each operand reduced to TF32 (:func:`tf32_round` with the installed mode; default
    :data:`DEFAULT_TF32`, "truncate": see :data:`TF32_MODES` for why), then multiplied (exact in float32) and
    summed in float32;
  - ``"tf32x3"``: Triton's F32DotTC decomposition (lib/Dialect/TritonGPU/Transforms/F32DotTC.cpp): big =
    ``cvt.rna.tf32.f32`` (round to nearest, ties away), small = x - big, then tf32 dots small.big + big.small from
    0, NaN replaced by 0, + big.big, + acc;

  bfloat16 / float16 operands widened exactly to float32, multiplied (exact) and summed in float32. Anything else
  (fp8, int8, a float16 or float64 accumulator) goes to the interpreter as before.
* ``cast_impl(src, dst_type)`` (``create_fp_trunc``, ``create_fp_ext``, ``create_fp_to_si`` ... and ``get_bf16``
  go through it): float32 -> bfloat16 truncated (``_convert_float`` with no rounding mode), any other type to or
  from bfloat16 converted as its uint16 bits (``astype``). Patched: bfloat16 widened exactly by its bits,
  anything -> bfloat16 through float32 rounded to nearest even (NaN -> 0x7FFF), as ``arith.truncf`` (``cvt.rn.bf16.f32``)
  does on a GPU.
* ``binary_op`` / ``unary_op`` (``create_fadd``, ``create_fmul``, comparisons, ``create_exp`` ...): on bfloat16
  operands the interpreter computes on the uint16 bits. Patched: widened to float32, computed, the float result
  rounded to nearest even back to bfloat16 (one rounding, as a GPU's bf16 instruction or its float32 emulation).

What it does not change (and so still differs from a GPU): the order of a dot's float32 sums (numpy's BLAS
order, not the tensor core's k-blocks, nor its accumulator, which is not IEEE float32), ``tl.exp2`` / ``tl.exp``
and divisions computed in IEEE float32 by numpy (a GPU's ``ex2.approx``, fast-math ``exp`` and ``div.full`` err by
a few ulp), no FMA contraction (triton's ``enable_fp_fusion``), reductions (``tl.sum`` / ``tl.max``) and scans over
bfloat16 tensors (still on the bits), float64 -> bfloat16 (rounded twice, through float32), fp8 conversions (the
interpreter's own ``_convert_float``) and dots of fp8 or int8 operands. Nothing here runs on a GPU: triton
compiles those kernels and this module is never asked. It models NVIDIA's arithmetic (ROCm's triton takes float32
dots as "ieee" by default).

The pure functions (:func:`tf32_round`, :func:`bf16_round_bits`, :func:`bf16_widen`) import neither triton nor
torch: the op checks use :func:`tf32_round` for their "TF32 inputs" likely cause
(mla_conformance.checks.op.compare)."""

from __future__ import annotations

import contextlib

import numpy as np

#: how a float32 operand of a ``"tf32"`` dot becomes TF32 (1 sign, 8 exponent, 10 explicit mantissa bits):
#:
#: * ``"truncate"`` (the default): the low 13 mantissa bits dropped. Triton's NVIDIA backend hands a tf32 dot's
#:   float32 registers to ``mma`` / ``wgmma`` ``.tf32`` as they are (``MMAv2.cpp`` packs the f32 values by bitcast;
#:   no conversion is emitted), and the tensor core reads only their top 19 bits ("only the first 10 bits of the
#:   input mantissa are read": PyTorch's TF32 note, pytorch/pytorch#79537). A Triton maintainer matched torch's
#:   TF32 matmul only after rounding the inputs himself with ``cvt.rna.tf32.f32`` (triton-lang/triton#4574), and
#:   Triton later added opt-in rounding of float32 inputs to TF32 (triton-lang/triton#9295, #9296);
#: * ``"rna"``: round to nearest, ties away from zero: ``cvt.rna.tf32.f32``, what Triton's tf32x3 uses for its big
#:   part and what a kernel (cuBLAS, CUTLASS's round_to_nearest converter) that rounds its inputs does;
#: * ``"rne"``: round to nearest even: a TMA load through a TFLOAT32 tensor map (the interpreter's own
#:   ``_round_f32_to_tf32``, used for descriptor loads only).
#:
#: ``.gpu_check/triton_decode.py`` measures which one a GPU's default tf32 dot does (an identity dot): run it on a
#: lent GPU and set the default from what it prints.
TF32_MODES = ("truncate", "rna", "rne")
DEFAULT_TF32 = "truncate"

_EXP = np.uint32(0x7F800000)
_TF32_KEEP = np.uint32(0xFFFFE000)

_state: dict = {"originals": None, "tf32": None}


# --------------------------------------------------------------------------- the number formats (numpy only)


def tf32_round(x, mode: str = DEFAULT_TF32) -> np.ndarray:
    """float32 values (any array-like) reduced to TF32 by ``mode`` (:data:`TF32_MODES`), kept as float32; inf and
    NaN as they are (a NaN stays NaN), values that round past the largest finite become inf (rna, rne)."""
    if mode not in TF32_MODES:
        raise ValueError(f"TF32 mode {mode!r}: expected one of {TF32_MODES}")
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    special = (bits & _EXP) == _EXP
    if mode == "truncate":
        out = bits & _TF32_KEEP
    elif mode == "rna":
        out = (bits + np.uint32(0x1000)) & _TF32_KEEP
    else:
        out = (bits + np.uint32(0xFFF) + ((bits >> np.uint32(13)) & np.uint32(1))) & _TF32_KEEP
    return np.where(special, bits, out).view(np.float32)


def bf16_round_bits(x) -> np.ndarray:
    """float32 values -> bfloat16 storage bits (uint16), rounded to nearest even (past the largest finite: inf);
    NaN -> 0x7FFF, the canonical NaN a GPU's ``cvt.rn.bf16.f32`` returns."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = ((bits & np.uint32(0x7FFFFFFF)) > _EXP)
    return np.where(nan, np.uint32(0x7FFF), rounded).astype(np.uint16)


def bf16_widen(bits) -> np.ndarray:
    """bfloat16 storage bits (uint16) -> float32, exactly."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


# --------------------------------------------------------------------------- the patched interpreter methods


def _patched(interp, tl, ir):
    """The replacement methods, closed over the interpreter module, triton.language and the IR enums."""
    orig = _state["originals"]
    TensorHandle = interp.TensorHandle
    prec = ir.INPUT_PRECISION
    bf16, fp16, fp32 = tl.bfloat16, tl.float16, tl.float32

    def tf32(x):
        return tf32_round(x, _state["tf32"])

    def widen(handle):
        ty = handle.dtype.scalar
        if ty == bf16:
            return bf16_widen(handle.data)
        return handle.data.astype(np.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        at, bt = a.dtype.scalar, b.dtype.scalar
        acc = d.data
        if acc.dtype != np.float32:
            return orig["create_dot"](self, a, b, d, input_precision, max_num_imprecise_acc)
        if at == fp32 and bt == fp32:
            if input_precision == prec.TF32:
                out = np.matmul(tf32(a.data), tf32(b.data)) + acc
            elif input_precision == prec.TF32x3:
                big_a, big_b = tf32_round(a.data, "rna"), tf32_round(b.data, "rna")
                small_a, small_b = a.data - big_a, b.data - big_b
                part = np.matmul(tf32(small_a), big_b)
                part = np.matmul(big_a, tf32(small_b)) + part
                part = np.where(np.isnan(part), np.float32(0), part)
                out = (np.matmul(big_a, big_b) + part) + acc
            else:  # "ieee" (and anything the interpreter does not know): IEEE float32
                return orig["create_dot"](self, a, b, d, input_precision, max_num_imprecise_acc)
        elif at in (bf16, fp16) and bt in (bf16, fp16):
            out = np.matmul(widen(a), widen(b)) + acc
        else:
            return orig["create_dot"](self, a, b, d, input_precision, max_num_imprecise_acc)
        return TensorHandle(out.astype(np.float32, copy=False), d.dtype.scalar)

    def cast_impl(self, src, dst_type):
        st, dt = src.dtype.scalar, dst_type.scalar
        if st != bf16 and dt != bf16 or st == dt:
            return orig["cast_impl"](self, src, dst_type)
        values = bf16_widen(src.data) if st == bf16 else src.data
        if dt == bf16:
            return TensorHandle(bf16_round_bits(values.astype(np.float32)), dt)
        return TensorHandle(values.astype(interp._get_np_dtype(dt)), dt)

    def binary_op(self, lhs, rhs, op):
        if lhs.dtype.scalar != bf16 or lhs.data.dtype != np.uint16:
            return orig["binary_op"](self, lhs, rhs, op)
        out = op(bf16_widen(lhs.data), widen(rhs) if rhs.dtype.scalar != bf16 else bf16_widen(rhs.data))
        if out.dtype == np.bool_:
            return TensorHandle(out, tl.int1)
        return TensorHandle(bf16_round_bits(out), bf16)

    def unary_op(self, arg, op):
        if arg.dtype.scalar != bf16 or arg.data.dtype != np.uint16:
            return orig["unary_op"](self, arg, op)
        return TensorHandle(bf16_round_bits(op(bf16_widen(arg.data))), bf16)

    return {"create_dot": create_dot, "cast_impl": cast_impl, "binary_op": binary_op, "unary_op": unary_op}


def install(tf32: str = DEFAULT_TF32) -> bool:
    """Patch Triton's interpreter (see the module docstring); ``tf32``: how a ``"tf32"`` dot takes its float32
    operands (:data:`TF32_MODES`). Idempotent (a second call only changes the mode). False, changing nothing,
    where triton is not installed."""
    if tf32 not in TF32_MODES:
        raise ValueError(f"TF32 mode {tf32!r}: expected one of {TF32_MODES}")
    try:
        import triton.language as tl
        from triton._C.libtriton import ir
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    _state["tf32"] = tf32
    if _state["originals"] is not None:
        return True
    builder = interp.InterpreterBuilder
    _state["originals"] = {name: builder.__dict__[name] for name in ("create_dot", "cast_impl", "binary_op",
                                                                      "unary_op")}
    for name, fn in _patched(interp, tl, ir).items():
        setattr(builder, name, fn)
    return True


def uninstall() -> None:
    """The interpreter's own methods back (nothing where :func:`install` was not called)."""
    originals = _state["originals"]
    if originals is None:
        return
    from triton.runtime import interpreter as interp

    for name, fn in originals.items():
        setattr(interp.InterpreterBuilder, name, fn)
    _state.update(originals=None, tf32=None)


def installed() -> str | None:
    """The TF32 mode of the installed emulation, or None where the interpreter is as triton ships it."""
    return _state["tf32"] if _state["originals"] is not None else None


@contextlib.contextmanager
def emulation(on: bool = True, tf32: str = DEFAULT_TF32):
    """The emulation installed (``on``) or not for the block, then as it was before."""
    before = installed()
    if on:
        install(tf32)
    else:
        uninstall()
    try:
        yield
    finally:
        if before is None:
            uninstall()
        else:
            install(before)

