"""The attention-backward pre/post-processing kernels' builds: each kernel compiled once per
configuration with fake tensors of symbolic sizes (``cc.CompileCache``, kept on disk), the
torch face (``ops.attention_bwd_prepost``) launching them."""

from __future__ import annotations

from layouts import attention_bwd_prepost as tiling

from . import _compile as cc


def _fake_seq(dtype, varlen, head_dim_static, vec):
    """A fake [B, S, H, D] or [total, H, D] tensor (sizes and strides symbolic)."""
    import cutlass.cute as cute

    d = head_dim_static if head_dim_static is not None else cute.sym_int()
    shape = (cute.sym_int(), cute.sym_int(), d) if varlen else (cute.sym_int(), cute.sym_int(), cute.sym_int(), d)
    return cc.fake_tensor(dtype, shape, vec)


def _fake_cu(varlen):
    import cutlass
    import cutlass.cute as cute

    return cc.fake_tensor(cutlass.Int32, (cute.sym_int(),), 1) if varlen else None


def _build_preprocess(
    dtype, head_dim_tile, vec, varlen, clear_dq_accum, arch, lse_log2=False, grad_lse=False, sink=False
):
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.attention_bwd_prepost import ComputeDotDoO

    if lse_log2 and arch != "sm_90a":
        raise ValueError(
            f"the LSE-rescaling preprocess serves the sm90 kernel (programmatic dependent launch): sm_90a, got {arch}"
        )
    t = tiling.preprocess_tiles(dtype.width, head_dim_tile, vec, arch)
    s = cute.sym_int
    acc = None
    if clear_dq_accum:
        acc_shape = (s(), s(), t.head_dim) if varlen else (s(), s(), s(), t.head_dim)
        acc = cc.fake_tensor(cutlass.Float32, acc_shape, 4)
    # the LSE's gradient: any strides (autograd hands over expanded ones)
    dlse = cc.fake_tensor(cutlass.Float32, (s(), s(), s()), 1, leading_dim=None) if grad_lse else None
    sink_args = (None, None)
    if sink:  # the [H] logits and the row terms, shaped as Δ
        sink_args = (cc.fake_tensor(cutlass.Float32, (s(),), 1), cc.fake_tensor(cutlass.Float32, (s(), s(), s()), 1))
    return cc.compile_kernel(
        ComputeDotDoO(dtype, t, varlen, clear_dq_accum, lse_log2, grad_lse, sink),
        _fake_seq(dtype, varlen, None, vec),
        _fake_seq(dtype, varlen, None, vec),
        cc.fake_tensor(cutlass.Float32, (s(), s(), s()), 1),
        acc,
        _fake_cu(varlen),
        *((cc.fake_tensor(cutlass.Float32, (s(), s(), s()), 1) for _ in range(2)) if lse_log2 else (None, None)),
        dlse,
        *sink_args,
        cutlass.Float32(1.0),
        cutlass.Int32(1),
        cc.fake_stream(),
        arch=arch,
    )


def _build_compute_delta(dtype, head_dim_tile, vec, varlen, arch):
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.attention_bwd_prepost import ComputeDelta

    t = tiling.compute_delta_tiles(dtype.width, head_dim_tile, vec, arch)
    s = cute.sym_int
    return cc.compile_kernel(
        ComputeDelta(dtype, t),
        _fake_seq(dtype, varlen, None, vec),
        _fake_seq(dtype, varlen, None, vec),
        cc.fake_tensor(cutlass.Float32, (s(), s(), s()), 1),
        _fake_cu(varlen),
        cc.fake_stream(),
        arch=arch,
    )


def _build_convert_dq(dtype, head_dim_tile, vec, varlen, arch):
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.attention_bwd_prepost import ConvertDQ

    t = tiling.postprocess_tiles(dtype.width, head_dim_tile, vec, arch)
    s = cute.sym_int
    acc_shape = (s(), s(), s(), t.head_dim) if varlen else (s(), s(), s(), s(), t.head_dim)
    return cc.compile_kernel(
        ConvertDQ(dtype, t, varlen),
        cc.fake_tensor(cutlass.Float32, acc_shape, 4),
        _fake_seq(dtype, varlen, None, vec),
        _fake_cu(varlen),
        cutlass.Float32(1.0),
        cutlass.Int32(1),
        cutlass.Int32(1),
        cc.fake_stream(),
        arch=arch,
    )


def _build_convert_dq_ready(dtype, head_dim_tile, vec, varlen, arch):
    """ConvertDQReady: behind the sm90 backward (programmatic dependent launch, sm_90a)."""
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.attention_bwd_prepost import ConvertDQReady

    if arch != "sm_90a":
        raise ValueError(f"ConvertDQReady follows the sm90 attention backward: sm_90a, got {arch}")
    t = tiling.postprocess_tiles(dtype.width, head_dim_tile, vec, arch)
    s = cute.sym_int
    acc_shape = (s(), s(), s(), t.head_dim) if varlen else (s(), s(), s(), s(), t.head_dim)
    i32 = cutlass.Int32
    return cc.compile_kernel(
        ConvertDQReady(dtype, t, varlen),
        cc.fake_tensor(cutlass.Float32, acc_shape, 4),
        _fake_seq(dtype, varlen, None, vec),
        _fake_cu(varlen),
        cc.fake_tensor(i32, (1,), 1),
        cc.fake_tensor(i32, (s(), s()), 1),
        cutlass.Float32(1.0),
        i32(1),
        i32(1),
        i32(1),
        i32(1),
        i32(1),
        cc.fake_stream(),
        arch=arch,
    )


def _build_convert_dkv(dtype, head_dim_tile, vec, varlen, arch):
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.attention_bwd_prepost import ConvertDKV

    t = tiling.postprocess_tiles(dtype.width, head_dim_tile, vec, arch)
    s = cute.sym_int
    acc = cc.fake_tensor(cutlass.Float32, (s(), s(), s(), t.head_dim), 4)
    return cc.compile_kernel(
        ConvertDKV(dtype, t, varlen),
        acc,
        acc,
        _fake_seq(dtype, varlen, None, vec),
        _fake_seq(dtype, varlen, None, vec),
        _fake_cu(varlen),
        cutlass.Float32(1.0),
        cutlass.Float32(1.0),
        cutlass.Int32(1),
        cc.fake_stream(),
        arch=arch,
    )


def _build_clear_dkv_accum(head_dim_tile, arch):
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.attention_bwd_prepost import ClearDKVAccum

    t = tiling.postprocess_tiles(16, head_dim_tile, 8, arch)
    s = cute.sym_int
    acc = cc.fake_tensor(cutlass.Float32, (s(), s(), s(), t.head_dim), 4)
    return cc.compile_kernel(ClearDKVAccum(t), acc, acc, cc.fake_stream(), arch=arch)


compiled_preprocess = cc.CompileCache("compute_dot_do_o", _build_preprocess)
compiled_compute_delta = cc.CompileCache("compute_delta", _build_compute_delta)
compiled_convert_dq = cc.CompileCache("convert_dq", _build_convert_dq)
compiled_convert_dq_ready = cc.CompileCache("convert_dq_ready", _build_convert_dq_ready)
compiled_convert_dkv = cc.CompileCache("convert_dkv", _build_convert_dkv)
compiled_clear_dkv_accum = cc.CompileCache("clear_dkv_accum", _build_clear_dkv_accum)
