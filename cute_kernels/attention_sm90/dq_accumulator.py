"""The dQ accumulator's protocols of the sm90 backward: the dQ-store warp's reduce-adds (or
stores) of each block's staged dQ, deterministic turns, store_first claims, zero_ahead zeroing
and the dq_ready counts."""

from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from cute_kernels.attention.named_barrier import NamedBarrier, cyclic
from layouts.attention_bwd_prepost import VARLEN_ACCUM_PAD

from .backward_config import (
    DKV_STORE_WARPS,
)

from .arguments import StoreArgs


@dataclass(frozen=True)
class DqBlock:
    """The dQ-store warp's step ``i``: query block ``m_block`` of query head ``head`` (key block
    ``n_block`` of sequence ``batch``, whose accumulator rows start at ``acc_row0``), its
    deterministic semaphore (else None) and store_first flag index, and the warp's lane."""

    i: Any
    head: Any
    m_block: Any
    batch: Any
    n_block: Any
    acc_row0: Any
    sem: Any
    flag: Any
    lane: Any


class DqAccumulatorMixin:
    """The dQ-store warp and the zeroing warps (``AttentionBackwardSm90``'s configuration).

    With ``dq_ready`` every CTA lets the launch behind it go at its start
    (griddepcontrol.launch_dependents) and counts its key block into a zeroed int32 per
    (sequence, key head) once its dQ adds are written (release): ``ConvertDQReady``, launched
    behind as a programmatic dependent, converts a head's dQ as soon as all its key blocks are
    counted, on the multiprocessors this grid's last wave leaves idle.

    ``store_first`` (the caller asks for it where every query block is seen by some key block):
    the accumulator is not zeroed; the first key block to reach a query block stores its dQ
    there (a TMA store instead of a reduce-add) and publishes it, the others add once it is
    published. A zeroed int32 per (batch, query head, query block) is 0 (free), 1 (claimed by
    the CTA storing it) or 2 (stored). The dQ-store warp claims a block by compare-and-swap
    before its dQ is staged; without a mask key block n walks its query blocks from
    n * blocks / key blocks on (``work_item``), so claims rarely meet.

    ``zero_ahead`` (persistent CTAs over equal tiles, "persistent" schedule): the accumulator is
    not zeroed by the preprocess either; the kernel zeroes it a round of tiles ahead. Each query block is
    owned by one key block of its head (a contiguous share, ``owned_blocks``); the producer
    warpgroup's dK / dV store warps, idle while a tile runs, zero the blocks their CTA's next tile
    owns (the first tile's at the CTA's start), each block claimed on its flag first (a zeroed
    int32 per (batch, query head, query block): 0 untouched, 1 being zeroed, 2 zeroed). The
    dQ-store warp reads a tile's flags 32 blocks at a time, without waiting, and looks at a
    block not yet seen zeroed again only when its copy is due (``wait_zeroed``): still untouched,
    it zeroes the block itself, so no CTA ever waits for one that has not started (persistent
    CTAs need not all be resident); being zeroed, it waits for the running zeroing warp. Blocks
    owned by a head's other tiles are zeroed a round ahead as long as a head's key blocks fit
    the grid, which the caller keeps (else the store warps would zero most blocks late). With
    tiles from the counter (causal masks) a CTA learns its next tile only near the end of the
    current one, so the zeroing warps of every CTA instead zero all blocks at the kernel's
    start, taking them from a second counter in the order the heavy-first walk reaches their
    heads (``zero_jobs``); the dQ-store warps' takeover is the same."""

    @cute.jit
    def store_dq(self, sa: StoreArgs, n_block, batch, work, rows, seqlen_q, seqlen_k, pending=None):
        """Add each query block's dQ (staged in sdQ by the consumers) into the fp32 accumulator
        (``store_first``: store it where this CTA claimed the block); with ``dq_ready`` then
        count the key block into its (sequence, key head)'s counter. ``pending`` (persistent
        CTAs, store_first): the last stored block's flag of the tile before, published here;
        this tile's is returned unpublished (the next tile's first handoff publishes it)."""
        t = self.tiles
        # varlen: sequence b's accumulator rows start VARLEN_ACCUM_PAD * b rows further down
        acc_row0 = rows.offset_q + batch * VARLEN_ACCUM_PAD if const_expr(self.varlen) else rows.offset_q
        lane = cute.arch.lane_idx()
        mDqFirst = sa.dq_first.flags
        # store_first: the flag of the block this CTA stored last, published once the next
        # block's copies are issued (its store has landed by then: no wait on the handoff's path)
        groups = 2 if const_expr(t.dq_per_wg) else 1  # bulk groups a block
        carried = pending is not None
        if const_expr(not carried):
            pending = Int32(-1)
        # the preprocess launch has zeroed the accumulator, or the store_first flags (PDL)
        cute.arch.griddepcontrol_wait()
        seen = Int32(0)  # zero_ahead: the blocks of the current 32-block window seen zeroed
        for i in cutlass.range(work.steps, unroll=1):
            head, m_block = self.work_item(work, i)
            sem = None
            if const_expr(self.deterministic):
                sem = sa.mSemaphore.iterator + cute.crd2idx((m_block, head, batch), sa.mSemaphore.layout)
            flag = Int32(0)
            if const_expr(self.store_first):
                flag = Int32(cute.crd2idx((m_block, head, batch), mDqFirst.layout))
            block = DqBlock(i, head, m_block, batch, n_block, acc_row0, sem, flag, lane)
            if const_expr(t.dq_per_wg):
                claim, pending, seen = self.copy_block_halves(sa, work, block, seqlen_q, seqlen_k, pending, seen)
            else:
                claim, pending, seen = self.copy_block(sa, work, block, seqlen_q, seqlen_k, pending, seen)
            if const_expr(self.store_first):
                # the block stored a step back: its store is older than this block's groups
                pending = self.publish_stored(mDqFirst, pending, lane, groups)
                if claim == 0:
                    pending = flag
            if const_expr(self.deterministic):
                # the adds are done (written, not only read) before the next key block's turn
                cute.arch.cp_async_bulk_wait_group(0, read=False)
                if lane == 0:
                    cute.arch.atomic_add(sem, Int32(1), sem="release", scope="gpu")
        if const_expr(self.store_first and not carried):
            pending = self.publish_stored(mDqFirst, pending, lane, 0)
        if const_expr(self.dq_ready):
            cute.arch.cp_async_bulk_wait_group(0, read=False)  # the adds written, not only read
            self.count_dq_ready(sa.mDqReady, Int32(cute.crd2idx((batch, work.head_kv), sa.mDqReady.layout)), lane)
        else:
            # sdQ read before the CTA leaves; the adds themselves are complete with the grid
            # (the next kernel, convert_dq, is stream-ordered behind it), as after a TMA store
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        return pending

    @cute.jit
    def copy_block(self, sa: StoreArgs, work, block, seqlen_q, seqlen_k, pending, seen):
        """One block's dQ, staged jointly by both warpgroups, into the accumulator: the staging
        buffer handed back, the block claimed (store_first) or its zeroing checked (zero_ahead),
        the staged dQ waited for, deterministic mode's turn, then one copy. Returns (claim,
        pending, seen) as ``store_dq`` carries them."""
        t = self.tiles
        handoff = t.dq_handoff_threads
        mDqFirst, lane = sa.dq_first.flags, block.lane
        claim = Int32(0)  # store_first: the flag's value before this CTA's claim (0: stored here)
        gdQ = cute.local_tile(
            self.seq_tile_view(sa.gdQ_tma, block.head, block.batch, block.acc_row0),
            (t.tile_m, t.head_dim),
            (block.m_block, 0),
        )
        tdQs, tdQg = cpasync.tma_partition(
            sa.tma_dQ, 0, cute.make_layout(1), cute.group_modes(sa.sdQ, 0, 2), cute.group_modes(gdQ, 0, 2)
        )
        # the buffer of this block is free once the reduce-add dq_stages blocks back has read it
        cute.arch.cp_async_bulk_wait_group(t.dq_stages - 1, read=True)
        cute.arch.barrier_arrive(barrier_id=NamedBarrier.DQ_EMPTY, number_of_threads=handoff)
        if const_expr(self.store_first):
            claim = self.claim_block(mDqFirst.iterator + block.flag, lane)
        seen = self.wait_zeroed(sa.dq_first, work, block.batch, block.i, seen, lane)
        cute.arch.barrier(barrier_id=NamedBarrier.DQ_FULL, number_of_threads=handoff)
        if const_expr(self.deterministic):
            self.spin_until(block.sem, self.dq_turn(block.m_block, block.n_block, seqlen_q, seqlen_k), lane)
        if const_expr(self.store_first):
            claim, pending = self.wait_stored(mDqFirst, block.flag, claim, pending, lane)
        self.copy_dq(sa.tma_dQ, sa.dq_first.tma_store, tdQs[None, block.i % t.dq_stages], tdQg, claim)
        cute.arch.cp_async_bulk_commit_group()
        return claim, pending, seen

    @cute.jit
    def copy_block_halves(self, sa: StoreArgs, work, block, seqlen_q, seqlen_k, pending, seen):
        """``copy_block`` with ``dq_per_wg``: each warpgroup's part of the block is its own handoff
        and copy (a bulk group each)."""
        t = self.tiles
        handoff = t.dq_handoff_threads
        am, an = t.dq_atoms
        sub = t.dq_sub_tile
        mDqFirst, lane = sa.dq_first.flags, block.lane
        claim = Int32(0)  # store_first: the flag's value before this CTA's claim (0: stored here)
        gdQ = cute.local_tile(
            self.seq_tile_view(sa.gdQ_tma, block.head, block.batch, block.acc_row0), sub, (None, None)
        )  # (rows, cols, m, n)
        if const_expr(t.dq_empty_early):
            # both buffers free before waiting for either: a warpgroup never waits for
            # the other's handoff (the reduce-add of w's buffer dq_stages blocks back
            # was committed 2 dq_stages - 1 - w groups ago)
            for w in cutlass.range_constexpr(2):
                cute.arch.cp_async_bulk_wait_group(2 * t.dq_stages - 1 - w, read=True)
                cute.arch.barrier_arrive(
                    barrier_id=NamedBarrier.DQ_EMPTY if w == 0 else NamedBarrier.DQ_EMPTY_WG1,
                    number_of_threads=handoff,
                )
            if const_expr(self.store_first):
                claim = self.claim_block(mDqFirst.iterator + block.flag, lane)
            seen = self.wait_zeroed(sa.dq_first, work, block.batch, block.i, seen, lane)
        for w in cutlass.range_constexpr(2):
            wm, wn = (w, 0) if am == 2 else (0, w)
            sdQ_w = cute.local_tile(sa.sdQ[None, None, block.i % t.dq_stages], sub, (wm, wn))
            tdQs, tdQg = cpasync.tma_partition(
                sa.tma_dQ, 0, cute.make_layout(1), cute.group_modes(sdQ_w, 0, 2), cute.group_modes(gdQ, 0, 2)
            )
            if const_expr(not t.dq_empty_early):
                # this part's reduce-add dq_stages blocks back has read it (two groups a block)
                cute.arch.cp_async_bulk_wait_group(2 * t.dq_stages - 1, read=True)
                cute.arch.barrier_arrive(
                    barrier_id=NamedBarrier.DQ_EMPTY if w == 0 else NamedBarrier.DQ_EMPTY_WG1,
                    number_of_threads=handoff,
                )
                if const_expr(self.store_first and w == 0):
                    claim = self.claim_block(mDqFirst.iterator + block.flag, lane)
                if const_expr(w == 0):
                    seen = self.wait_zeroed(sa.dq_first, work, block.batch, block.i, seen, lane)
            cute.arch.barrier(
                barrier_id=NamedBarrier.DQ_FULL if w == 0 else NamedBarrier.DQ_FULL_WG1,
                number_of_threads=handoff,
            )
            if const_expr(self.deterministic and w == 0):
                self.spin_until(block.sem, self.dq_turn(block.m_block, block.n_block, seqlen_q, seqlen_k), lane)
            if const_expr(self.store_first and w == 0):
                claim, pending = self.wait_stored(mDqFirst, block.flag, claim, pending, lane)
            self.copy_dq(sa.tma_dQ, sa.dq_first.tma_store, tdQs, tdQg[None, block.m_block * am + wm, wn], claim)
            cute.arch.cp_async_bulk_commit_group()
        return claim, pending, seen

    @cute.jit
    def wait_zeroed(self, dq_first, work, batch, i, seen, lane):
        """zero_ahead, before the copies of a tile's block ``i``: returns ``seen``, a bit per block
        of i's 32-block window whose flag read zeroed (2). Each window is read once, at its first
        block, without waiting; a block not seen then is looked at again only when its copy is
        due (its owner may run a little behind: waiting for every block at the tile's start held
        up the first one behind the latest owner). A block still untouched then (0: its owner's
        CTA may not even be resident, e.g. beside another kernel or under MPS) is zeroed here
        (``zero_block`` claims it first); one being zeroed (1) is waited for, its zeroing warp is
        running. The zeros (generic stores) and the reduce-adds (async proxy) are fenced on both
        sides: the zeroing warp before its release, this warp after its acquire (measured: the
        same speed with the writers' fence alone). Placed where claim_block is: after the staging
        buffer's handback."""
        if const_expr(self.zero_ahead):
            mFlags = dq_first.flags
            w = cyclic(i, 32)
            if w == 0:
                j = i + lane
                ok = Int32(1)
                if j < work.steps:
                    ok = Int32(
                        cute.arch.load(self.zero_flag(mFlags, work, batch, j), Int32, sem="acquire", scope="gpu") == 2
                    )
                seen = cute.arch.vote_ballot_sync(ok != 0)
                cute.arch.fence_proxy("async.global")
            if (seen >> w) & 1 == 0:
                head, m_block = self.work_item(work, i)
                if not self.zero_block(dq_first, head, batch, m_block, lane):
                    self.spin_until(self.zero_flag(mFlags, work, batch, i), Int32(2), lane)
                cute.arch.fence_proxy("async.global")
        return seen

    @cute.jit
    def zero_flag(self, mFlags, work, batch, j):
        """zero_ahead: the flag of the tile's j-th block (``work_item``'s order, no rotation)."""
        blocks = work.m_max - work.m_min
        g = j // blocks
        m = work.m_min + j - g * blocks
        return mFlags.iterator + cute.crd2idx((m, work.head_kv * work.group + g, batch), mFlags.layout)

    @cute.jit
    def owned_blocks(self, n_block, seqlen_q, seqlen_k):
        """zero_ahead without a mask: the query blocks key block ``n_block`` zeroes, [lo, hi) (of
        every query head of its group): the key blocks split a head's query blocks into
        contiguous shares, each block owned once (none where there are more key blocks than
        query blocks)."""
        t = self.tiles
        m_blocks = cute.ceil_div(seqlen_q, t.tile_m)
        n_blocks = cute.ceil_div(seqlen_k, t.tile_n)
        lo = (n_block * m_blocks + n_blocks - 1) // n_blocks
        hi = ((n_block + 1) * m_blocks + n_blocks - 1) // n_blocks
        return lo, hi

    @cute.jit
    def zero_jobs(self, dq_first, counter, sched, group, seqlen_q):
        """Causal zero_ahead (tiles from the counter): the zeroing warps of every CTA take query
        blocks from a second counter, in the order the heavy-first walk reaches their heads
        ((batch, key head) pairs, their query heads, blocks ascending), and zero them at the
        kernel's start, until none is left; the dQ-store warps zero a block nobody has reached
        yet themselves (``wait_zeroed``)."""
        t = self.tiles
        heads_kv, batches = sched.heads_kv, sched.batches
        m_blocks = cute.ceil_div(seqlen_q, t.tile_m)
        per_pair = group * m_blocks
        total = batches * heads_kv * per_pair
        lane = cute.arch.lane_idx()
        j = self.take_job(counter, lane)
        while j < total:
            pair = j // per_pair
            r = j - pair * per_pair
            g = r // m_blocks
            batch = pair // heads_kv
            self.zero_block(dq_first, (pair - batch * heads_kv) * group + g, batch, r - g * m_blocks, lane)
            j = self.take_job(counter, lane)

    @cute.jit
    def take_job(self, counter, lane):
        """Causal zero_ahead: the next zeroing job (a query block's index) for this warp."""
        taken = Int32(0)
        if lane == 0:
            taken = cute.arch.atomic_add(counter, Int32(1), sem="relaxed", scope="gpu")
        return cute.arch.shuffle_sync(taken, 0)

    @cute.jit
    def zero_owned(self, dq_first, sched, tile, group, seqlen_q, seqlen_k, part):
        """zero_ahead: zero the accumulator blocks tile ``tile`` owns, the two zeroing warps taking
        every other one (``part``); a block someone else claimed is skipped."""
        n_block, head_kv, batch = self.scheduler.coords_of(sched, tile)
        lo, hi = self.owned_blocks(n_block, seqlen_q, seqlen_k)
        lane = cute.arch.lane_idx()
        for k in cutlass.range(part, group * (hi - lo), len(DKV_STORE_WARPS), unroll=1):
            g = k // (hi - lo)
            self.zero_block(dq_first, head_kv * group + g, batch, lo + k - g * (hi - lo), lane)

    @cute.jit
    def zero_block(self, dq_first, head, batch, m_block, lane):
        """zero_ahead: claim query block ``m_block`` of ``head`` (its flag 0 -> 1, compare-and-swap)
        and, if this warp got it, zero its accumulator rows by 16-byte stores, fence them for the
        async proxy and publish it (release 2: the warp's barrier orders its lanes' stores before
        lane 0's release). Returns whether this warp zeroed it."""
        t = self.tiles
        mFlags, mAcc = dq_first.flags, dq_first.accum
        flag = mFlags.iterator + cute.crd2idx((m_block, head, batch), mFlags.layout)
        old = Int32(0)
        if lane == 0:
            old = cute.arch.atomic_cas(flag, cmp=Int32(0), val=Int32(1), sem="relaxed", scope="gpu")
        mine = cute.arch.shuffle_sync(old, 0) == 0
        if mine:
            zero_copy = t.dq_accum_zero_copy()
            tG = zero_copy.get_slice(lane).partition_D(
                cute.local_tile(mAcc[None, None, head, batch], (t.tile_m, t.head_dim), (m_block, 0))
            )
            zeros = cute.make_fragment_like(tG[None, 0, None])
            zeros.fill(0.0)
            for r in cutlass.range(cute.size(tG, mode=[1]), unroll=1):
                cute.copy(zero_copy, zeros, tG[None, r, None])
            # the zeros (generic proxy) ordered before the reduce-adds (async proxy) that the flag
            # releases, as threads fence their shared-memory writes before a TMA store
            cute.arch.fence_proxy("async.global")
            cute.arch.sync_warp()
            if lane == 0:
                cute.arch.store(flag, Int32(2), sem="release", scope="gpu")
            cute.arch.sync_warp()
        return mine

    @cute.jit
    def claim_block(self, flag, lane):
        """store_first: the block's flag before this CTA's compare-and-swap 0 -> 1, in lane 0
        (0: this CTA stores the block's first dQ; 1: another CTA is storing it; 2: stored, add).
        Issued once the staging buffer is handed back (a barrier arrive waits for the lane's
        memory operations before it: ahead of it the round trip held up the consumers, H100
        8x16x1024x64 -9%); the barrier for the staged dQ waits for it. ``wait_stored`` hands
        the result to the warp."""
        old = Int32(0)
        if lane == 0:
            # acquire: where the block is already stored (2), the adds come after that store
            old = cute.arch.atomic_cas(flag, cmp=Int32(0), val=Int32(1), sem="acquire", scope="gpu")
        return old

    @cute.jit
    def publish_stored(self, mDqFirst, pending, lane, newer: cutlass.Constexpr):
        """store_first: mark the block of flag index ``pending`` (-1: none) stored once its
        stores are written, all bulk groups but the ``newer`` last ones (a release after the async
        proxy's writes, as count_dq_ready); returns -1."""
        if pending >= 0:
            cute.arch.cp_async_bulk_wait_group(newer, read=False)
            cute.arch.fence_proxy("async.global")
            if lane == 0:
                cute.arch.store(mDqFirst.iterator + pending, Int32(2), sem="release", scope="gpu")
            cute.arch.sync_warp()
        return Int32(-1)

    @cute.jit
    def wait_stored(self, mDqFirst, flag, old, pending, lane):
        """store_first, before a block's copies: (the claim's result for the warp, ``pending``).
        Where another CTA claimed the block (1), this CTA's own stored block is published first
        (so no two CTAs wait for each other), then the claimer's store is waited for: a claimer
        publishes without waiting for any other CTA. The acquire orders the reduce-add after
        the store, as deterministic mode's turns do."""
        claim = cute.arch.shuffle_sync(old, 0)
        if claim == 1:
            pending = self.publish_stored(mDqFirst, pending, lane, 0)
            self.spin_until(mDqFirst.iterator + flag, Int32(2), lane)
        return claim, pending

    @cute.jit
    def copy_dq(self, tma_dQ, tma_dQ_store, src, dst, claim):
        """A block's dQ (part) into the accumulator: added, or stored where ``claim`` is 0
        (store_first, this CTA claimed the block)."""
        if const_expr(self.store_first):
            if claim == 0:
                cute.copy(tma_dQ_store, src, dst)
            else:
                cute.copy(tma_dQ, src, dst)
        else:
            cute.copy(tma_dQ, src, dst)

    @cute.jit
    def count_dq_ready(self, mDqReady, index, lane):
        """dq_ready: count a key block whose dQ adds are written (the caller waited for them)
        into entry ``index`` of mDqReady, with release semantics."""
        cute.arch.fence_proxy("async.global")  # the async proxy's adds, then the generic release
        if lane == 0:
            # release, not relaxed: the bulk adds' completion alone does not make them visible
            # to other CTAs (H100, a relaxed count let convert read partial sums: 6.5e-2 error)
            cute.arch.atomic_add(mDqReady.iterator + index, Int32(1), sem="release", scope="gpu")

    @cute.jit
    def spin_until(self, ptr, value, lane):
        """Lane 0 polls the int32 at ``ptr`` (acquire, gpu scope) until it reads ``value``, then
        the warp goes on: deterministic mode's turns (``value`` key blocks have added into the
        query block), a store_first block stored, a zero_ahead block zeroed (2)."""
        if lane == 0:
            while cute.arch.load(ptr, Int32, sem="acquire", scope="gpu") != value:
                cute.arch.inline_ptx("nanosleep.u32 20;")
        cute.arch.sync_warp()

    @cute.jit
    def dq_turn(self, m_block, n_block, seqlen_q, seqlen_k):
        """Deterministic mode: how many key blocks add into query block ``m_block`` before
        key block ``n_block``. Without a mask every key block sees every query block and
        they go in ascending order, the order CTAs are launched (a CTA never waits for one
        not yet resident behind it). With a causal mask key block n starts at the diagonal,
        so the last key block that sees a query block reaches it first: descending order.
        The key blocks that see a query block are consecutive (a window cuts the low end)."""
        t = self.tiles
        turn = n_block
        if const_expr(self.mask_type != 0):
            n_last = cute.ceil_div(seqlen_k, t.tile_n) - 1
            # the block's last query sees keys up to here (>= 0 for a block some key block sees)
            reach = (m_block + 1) * t.tile_m - 1 + self.mask.causal_offset(seqlen_q, seqlen_k)
            if reach // t.tile_n < n_last:
                n_last = reach // t.tile_n
            turn = n_last - n_block
        return turn
