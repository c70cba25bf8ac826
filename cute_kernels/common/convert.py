"""fp32 register fragments to fp16 / bf16, two values per instruction.

``TensorSSA.to(dtype)`` lowers to one ``cvt.rn.bf16.f32`` per value for most fragment
shapes (only some vectorise to the packed form), and the lone halves then cost a
``mov.b32`` each to pair up for wgmma. ``cvt.rn.{bf16x2,f16x2}.f32`` converts and packs
two values in one instruction, with the same rounding (to nearest even).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def pack_f32x2(lo: Float32, hi: Float32, dtype: type, *, loc=None, ip=None) -> Int32:
    """``lo`` and ``hi`` rounded to ``dtype`` (fp16 / bf16), ``lo`` in the low half."""
    kind = "bf16x2" if dtype is cutlass.BFloat16 else "f16x2"
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Float32(lo).ir_value(loc=loc, ip=ip), Float32(hi).ir_value(loc=loc, ip=ip)],
            f"cvt.rn.{kind}.f32 $0, $2, $1;",  # the first source lands in the upper half
            "=r,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
            loc=loc,
            ip=ip,
        )
    )


@cute.jit
def convert_packed(src: cute.Tensor, dst: cute.Tensor):
    """dst (fp16 / bf16, src's size) <- src (fp32), value i of each in the same place."""
    if cutlass.const_expr(dst.element_type not in (cutlass.BFloat16, cutlass.Float16)):
        raise TypeError(f"convert_packed writes fp16 / bf16, not {dst.element_type}")
    words = cute.recast_tensor(dst, Int32)
    n = cute.size(words)
    for i0 in cutlass.range_constexpr(0, n, 32):  # (the DSL warns of static loops over 32: d256's O has 64 words)
        for i in cutlass.range_constexpr(i0, min(i0 + 32, n)):
            words[i] = pack_f32x2(src[2 * i], src[2 * i + 1], dst.element_type)
