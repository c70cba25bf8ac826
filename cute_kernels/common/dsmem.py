"""Stores into another CTA's shared memory (distributed shared memory, sm_90 clusters).

The LayerNorm forward and backward exchange their row sums across the CTAs of a cluster
with these: a plain remote store (then a cluster barrier), or ``st.async``, whose bytes
complete a transaction count on the receiving CTA's mbarrier.
"""

import cutlass.cute as cute
from cutlass import Float32, Int32


@cute.jit
def store_cluster(ptr: cute.Pointer, value: Float32, peer: Int32):
    """Store ``value`` at shared-memory address ``ptr`` of CTA ``peer`` of the cluster."""
    addr = cute.arch.map_dsmem_ptr(ptr, peer).toint()
    cute.arch.inline_ptx("st.shared::cluster.f32 [{$r0}], {$r1};", read_only_args=[Int32(addr), value])


@cute.jit
def store_async_cluster(ptr: cute.Pointer, mbar: cute.Pointer, v: Float32, peer: Int32):
    """``v`` at ``ptr`` of CTA ``peer``; completes 4 tx bytes on ``mbar`` there."""
    addr = cute.arch.map_dsmem_ptr(ptr, peer).toint()
    bar = cute.arch.map_dsmem_ptr(mbar, peer).toint()
    cute.arch.inline_ptx(
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [{$r0}], {$r1}, [{$r2}];",
        read_only_args=[Int32(addr), v, Int32(bar)],
    )


@cute.jit
def store_async_cluster2(ptr: cute.Pointer, mbar: cute.Pointer, v0: Float32, v1: Float32, peer: Int32):
    """(v0, v1) at 8-byte aligned ``ptr`` of CTA ``peer``; completes 8 tx bytes on ``mbar`` there."""
    addr = cute.arch.map_dsmem_ptr(ptr, peer).toint()
    bar = cute.arch.map_dsmem_ptr(mbar, peer).toint()
    cute.arch.inline_ptx(
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [{$r0}], {{$r1}, {$r2}}, [{$r3}];",
        read_only_args=[Int32(addr), v0, v1, Int32(bar)],
    )
