"""Stores into another CTA's shared memory (distributed shared memory, sm_90 clusters).

The LayerNorm forward and backward exchange their row sums across the CTAs of a cluster
with these: a plain remote store (then a cluster barrier), or ``st.async``, whose bytes
complete a transaction count on the receiving CTA's mbarrier.
"""

import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr


@cute.jit
def store_cluster(ptr: cute.Pointer, value: Float32, peer: Int32):
    """Store ``value`` at shared-memory address ``ptr`` of CTA ``peer`` of the cluster."""
    addr = cute.arch.map_dsmem_ptr(ptr, peer).toint()
    cute.arch.inline_ptx("st.shared::cluster.f32 [{$r0}], {$r1};", read_only_args=[Int32(addr), value])


@cute.jit
def store_async_cluster(ptr: cute.Pointer, mbar: cute.Pointer, values: list, peer: Int32):
    """``values`` (one fp32, or two at an 8-byte aligned ``ptr``) at ``ptr`` of CTA ``peer``;
    completes their bytes on ``mbar`` there."""
    addr = cute.arch.map_dsmem_ptr(ptr, peer).toint()
    bar = cute.arch.map_dsmem_ptr(mbar, peer).toint()
    if const_expr(len(values) == 1):
        ptx = "st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [{$r0}], {$r1}, [{$r2}];"
    else:
        ptx = "st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [{$r0}], {{$r1}, {$r2}}, [{$r3}];"
    cute.arch.inline_ptx(ptx, read_only_args=[Int32(addr), *values, Int32(bar)])
