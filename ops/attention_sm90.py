"""Torch face of the Hopper-native attention backward (``cute_kernels.attention_sm90``).

Three launches: our preprocess (Δ = rowsum(dO∘O) and a zeroed fp32 dQ accumulator, or
with ``store_first`` an unzeroed one: the kernel stores each query block's first dQ; with
``zero_ahead`` persistent CTAs zero it themselves, a round of tiles ahead),
the sm90 kernel (dK, dV, dQ added into the accumulator), our ``convert_dq`` (where the
kernel's last wave leaves multiprocessors idle, ``ConvertDQReady``: launched early, it
converts each head once the kernel has counted all its key blocks; ``_overlaps_convert``).
``unsupported`` says why this path cannot take a problem (None: it can);
``ops.efficient_attention_backward`` and ``ops.memory_efficient_attention`` choose
between it and the sm80-structured kernel (``backend=``, see ``ops.attention``).
dQ is summed by TMA reduce-adds in whatever order the key blocks finish (not bitwise
reproducible from run to run) unless ``deterministic``: then in a fixed key-block order.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import cutlass
import cutlass.cute as cute
import torch
from torch import Tensor

from cute_kernels.attention_sm90.attention_backward_sm90 import AttentionBackwardSm90
from cute_kernels.attention_sm90 import backward_config as bwd_config
from cute_kernels.attention_sm90.attention_backward_sm90_wide import AttentionBackwardSm90Wide
from layouts import attention_sm90 as tiling
from layouts.attention_bwd_prepost import round_up

from . import _compile as cc
from . import attention_bwd_prepost as P
from ._memo import Memo
from .attention_common import AttentionBackwardArgs, grad_bias_buffer, remembered_verdict, tma_misaligned

DTYPES = (torch.float16, torch.bfloat16)


def _tiles(head_dim: int, head_dim_v: int, bias: bool, grad_bias: bool, dropout: bool):
    """The tiles a configuration compiles with (also read on the call path: deterministic
    mode's semaphore shape, the heavy-first chunk; cached by ``attention_sm90_tiles``)."""
    return bwd_config.attention_sm90_tiles(
        head_dim, head_dim_v=head_dim_v, ds_keys_contiguous=grad_bias, bias_or_dropout=bias or dropout
    )


@dataclass(frozen=True)
class Sm90Config:
    """One compiled configuration, the ``compiled`` key. ``head_dim`` is Dqk (Q, K),
    ``head_dim_v`` Dv (V, dO). ``grad_bias``: the bias gradient leaves by TMA from a
    keys-contiguous dS tile (``ds_keys_contiguous``); ``carry_dq``: short tiles of persistent
    CTAs (``_carries_dq``); ``dq_ready``: the kernel counts each key block's dQ for
    ConvertDQReady behind it (``DQ_READY``); ``store_first``: each query block's first dQ is
    stored, no zeroed accumulator (``_stores_first``); ``zero_ahead``: persistent CTAs zero the
    accumulator a round of tiles ahead (``_zeroes_ahead``); ``tail_m``: the partial last query
    block's products that many queries wide (``_tail_m``); ``rng_on_device``: dropout's seed and
    offset read from device tensors (``_compile.dropout_args``); ``softcap``: the forward capped
    the scores (the cap is a runtime argument); ``seqused``: used lengths per sequence (int32
    tensors read on the device)."""

    dtype: type
    head_dim: int
    head_dim_v: int
    mask_type: int
    arch: str
    window: bool = False
    deterministic: bool = False
    varlen: bool = False
    bias: bool = False
    grad_bias: bool = False
    dropout: bool = False
    carry_dq: bool = False
    dq_ready: bool = False
    store_first: bool = False
    zero_ahead: bool = False
    tail_m: int = 0
    rng_on_device: bool = False
    softcap: bool = False
    seqused: bool = False

    def __post_init__(self):
        # the key's repr names its disk-cache entry: one spelling per value (1 and True are one
        # key in memory, two on disk); a seed on the device means nothing without dropout
        for f in dataclasses.fields(self):
            cast = _CASTS.get(f.type)
            if cast is not None:
                object.__setattr__(self, f.name, cast(getattr(self, f.name)))
        object.__setattr__(self, "rng_on_device", self.dropout and self.rng_on_device)


_CASTS = {"int": int, "bool": bool, int: int, bool: bool}  # by annotation (a string under future annotations)


def _build(config: Sm90Config):
    """Compile one configuration (``Sm90Config``)."""
    c = config
    tiles = _tiles(c.head_dim, c.head_dim_v, c.bias, c.grad_bias, c.dropout)
    # a head dim above 128: the 64 x 64 decomposition (P^T / dS^T through shared memory)
    cls = AttentionBackwardSm90Wide if isinstance(tiles, bwd_config.AttentionSm90WideTiles) else AttentionBackwardSm90
    kernel = cls(
        c.dtype,
        tiles,
        c.mask_type,
        c.window,
        c.deterministic,
        c.varlen,
        c.bias,
        c.grad_bias,
        c.dropout,
        carry_dq=c.carry_dq,
        dq_ready=c.dq_ready,
        store_first=c.store_first,
        zero_ahead=c.zero_ahead,
        tail_m=c.tail_m,
        softcap=c.softcap,
        seqused=c.seqused,
    )
    return cc.compile_kernel(kernel, *_fake_args(c, kernel.dynamic_tiles), cc.fake_stream(), arch=c.arch)


def _fake_args(c: Sm90Config, dynamic: bool) -> tuple:
    """The kernel's arguments as fake tensors of symbolic sizes and strides (``dynamic``: the
    tiles come from a counter)."""
    dtype, head_dim, head_dim_v = c.dtype, c.head_dim, c.head_dim_v
    b, h, hk, mq, mk = (cute.sym_int() for _ in range(5))
    # TMA: last stride 1, the other strides and the addresses multiples of TMA_ALIGN_BYTES
    vec, vec32 = tiling.tma_align_elems(dtype.width), tiling.tma_align_elems(32)
    q = cc.fake_tensor(dtype, (b, mq, h, head_dim), vec)
    do = cc.fake_tensor(dtype, (b, mq, h, head_dim_v), vec)
    k, dk = (cc.fake_tensor(dtype, (b, mk, hk, head_dim), vec) for _ in range(2))
    v, dv = (cc.fake_tensor(dtype, (b, mk, hk, head_dim_v), vec) for _ in range(2))
    # per-sequence tensors: with varlen the sequences are not the packed tensors' batch (1)
    seqs = cute.sym_int() if c.varlen else b
    lse, delta = (cc.fake_tensor(cutlass.Float32, (seqs, h, cute.sym_int()), vec32) for _ in range(2))
    dq_accum = cc.fake_tensor(cutlass.Float32, (b, cute.sym_int(), h, head_dim), vec32)
    semaphore = cc.fake_tensor(cutlass.Int32, (seqs, h, cute.sym_int()), 1) if c.deterministic else None
    # the tile counter, zeroed (causal zero_ahead: and the zeroing jobs' counter)
    counter = cc.fake_tensor(cutlass.Int32, (2 if c.zero_ahead else 1,), 1) if dynamic else None
    # dQ's key blocks per (sequence, key head)
    ready = cc.fake_tensor(cutlass.Int32, (seqs, hk), 1) if c.dq_ready else None
    # store_first / zero_ahead: a flag per (batch, query head, query block), zeroed
    first = cc.fake_tensor(cutlass.Int32, (b, h, cute.sym_int()), 1) if c.store_first or c.zero_ahead else None
    cu_q, cu_k = (cc.fake_tensor(cutlass.Int32, (cute.sym_int(),), 1) if c.varlen else None for _ in range(2))
    # the bias: any strides (0 for broadcast dims; read element by element); its gradient
    # dense rows (padded to 128 bits, as torch's) with any row stride
    bias = cc.fake_tensor(dtype, (b, h, mq, mk), 1, leading_dim=None) if c.bias else None
    # TMA-stored: row stride and address multiples of 16 bytes (torch's padded rows)
    grad_bias = cc.fake_tensor(dtype, (b, h, mq, mk), vec) if c.grad_bias else None
    rng = cc.fake_rng_args(c.rng_on_device) if c.dropout else (None,) * 5
    tensors = (q, k, v, do, lse, delta, dq_accum, dk, dv, semaphore, counter, ready, first, cu_q, cu_k)
    # softmax scale, window, max_seqlen_k, heads per chunk, persistent CTAs, softcap
    scalars = (cutlass.Float32(1.0), cutlass.Int32(0), cutlass.Int32(0), cutlass.Int32(1), cutlass.Int32(1))
    scalars += (cutlass.Float32(1.0),)
    used = tuple(cc.fake_tensor(cutlass.Int32, (seqs,), 1) if c.seqused else None for _ in range(2))
    return (*tensors, bias, grad_bias, *scalars, *used, *rng)


compiled = cc.CompileCache("attention_bwd_sm90", _build)


# convert_dq overlapping the kernel's last wave (_overlaps_convert): the kernel counts each key
# block's dQ per (sequence, key head), ConvertDQReady (a programmatic dependent launch) converts
# each head once its count is complete (where a head has at most bwd_config.DQ_READY_MAX_KEY_BLOCKS
# key blocks). H100, device time from the kernel's start to convert_dq's end (torch profiler,
# medians of 7 x 7 calls): 4x16x2048x128 592.8 -> 579.1 us, 2x16x4096x128 1099.7 -> 1082.4,
# 4x16x2048x96 535.0 -> 527.6, 8x16x1024x128 340.8 -> 339.5 (docs/attention_sm90.md)
DQ_READY = True


def _overlaps_convert(schedule: str, mask_type: int, deterministic: bool, key_blocks: int) -> bool:
    """Whether the call takes ConvertDQReady: a CTA per tile in launch order ("grid", no
    heavy-first order), whose last wave leaves multiprocessors idle while the heads before are
    complete. Persistent CTAs and the heavy-first order of causal masks end all multiprocessors
    nearly together, so the counts would cost without an overlap (causal d128 +0.7%)."""
    return (
        DQ_READY
        and schedule == "grid"
        and (mask_type == 0 or deterministic)
        and key_blocks <= bwd_config.DQ_READY_MAX_KEY_BLOCKS
    )


# each query block's first dQ stored instead of added into a zeroed accumulator (_stores_first)
STORE_FIRST = True


def _stores_first(
    tiles, mask_type: int, window: bool, deterministic: bool, varlen: bool, rows_q: int, rows_k: int
) -> bool:
    """Whether the kernel stores each query block's first dQ (``store_first``), so that the
    preprocess need not zero the accumulator: for tiles that ask for it (``tiles.store_first``,
    measured per head dim), where every query block is seen by some key block (no mask;
    top-left causal; bottom-right with Sq <= Sk; no window), without deterministic mode's
    ordered adds or varlen's per-sequence rows. A block no key block sees would keep whatever
    the accumulator held."""
    reached = mask_type in (0, 1) or rows_q <= rows_k
    return STORE_FIRST and tiles.store_first and reached and not (window or deterministic or varlen) and rows_k > 0


# persistent CTAs zero the dQ accumulator themselves instead of the preprocess (_zeroes_ahead):
# over equal tiles a round of tiles ahead, causal ones (tiles from a counter) every block at the
# kernel's start from a counter of zeroing jobs
ZERO_AHEAD = True
ZERO_AHEAD_CAUSAL = True


def _zeroes_ahead(
    schedule: str, store_first: bool, key_blocks: int, ctas: int, steps: int, reached: bool = True
) -> bool:
    """Whether the kernel zeroes the accumulator itself (``zero_ahead``), where it does not store
    first and every query block is ``reached`` by some key block (no window; bottom-right only
    with Sq <= Sk). Persistent CTAs over equal tiles (schedule "persistent", no mask) zero their
    next tile's blocks a round ahead; a head's tiles must lie within two rounds of the ``ctas``
    CTAs (``key_blocks`` <= ``ctas``), beyond that the dQ-store warps would find most blocks
    untouched and zero them late themselves (correct, as when a CTA is not resident, but slow);
    tiles of at most ``ZERO_AHEAD_MAX_STEPS`` ``steps`` (query heads x query blocks): the saving
    is fixed, the cost per step. Causal tiles from the counter (schedule "dynamic"): the zeroing
    warps of every CTA zero all blocks at the kernel's start, in the walk's head order, from a
    counter of jobs (``ZERO_AHEAD_CAUSAL``)."""
    if not ZERO_AHEAD or store_first or not reached:
        return False
    if schedule == "persistent":
        return key_blocks <= ctas and steps <= bwd_config.ZERO_AHEAD_MAX_STEPS
    return schedule == "dynamic" and ZERO_AHEAD_CAUSAL


# the partial last query block on narrower products (_tail_m)
TAIL_BLOCK = True


def _tail_m(tiles, schedule: str, rows_q: int, varlen: bool, bias: bool, dropout: bool) -> int:
    """The queries a partial last block's products cover (the kernel's ``tail_m``; 0: whole
    blocks everywhere), where the kernel takes it (``AttentionBackwardSm90.takes_tail``). Every
    remainder of rows_q by tile_m is its own compiled kernel (at most tile_m / 16 of them per
    configuration)."""
    if not TAIL_BLOCK or not AttentionBackwardSm90.takes_tail(tiles, schedule, varlen, bias, dropout):
        return 0
    return tiles.tail_rows(rows_q)


def _carries_dq(tiles, schedule: str, rows_q: int, group: int) -> bool:
    """Whether the kernel computes a tile's last dQ in the next tile's step 0: persistent CTAs
    over equal tiles (``schedule`` "persistent", AttentionBackwardSm90.tile_schedule) of at most
    ``CARRY_DQ_MAX_STEPS`` steps (group x query blocks)."""
    return schedule == "persistent" and tiles.carries_dq(group * -(-rows_q // tiles.tile_m))


def _plan(
    dtype,
    head_dim: int,
    head_dim_v: int,
    mask_type: int,
    arch: str,
    *,
    window: bool,
    deterministic: bool,
    varlen: bool,
    bias: bool,
    grad_bias: bool,
    dropout: bool,
    rows_q: int,
    group: int,
    rows_k: int,
    ctas: int,
    rng_on_device: bool = False,
    softcap: bool = False,
    seqused: bool = False,
) -> tuple:
    """(tiles, tile schedule, ``Sm90Config``) of one call: the choices made per call from the
    configuration, the query rows (``carry_dq``), the key rows (``dq_ready``, ``zero_ahead``)
    and the persistent grid's CTAs (``zero_ahead``). Used lengths (``seqused``) are lengths per
    sequence on the device, as varlen's: the choices that need the host to know them are off."""
    tiles = _tiles(head_dim, head_dim_v, bias, grad_bias, dropout)
    per_seq = varlen or seqused
    schedule = AttentionBackwardSm90.tile_schedule(tiles, mask_type, window, deterministic, per_seq, bias, dropout)
    carry = _carries_dq(tiles, schedule, rows_q, group)
    first = _stores_first(tiles, mask_type, window, deterministic, per_seq, rows_q, rows_k)
    key = Sm90Config(
        dtype,
        head_dim,
        head_dim_v,
        mask_type,
        arch,
        window=window,
        deterministic=deterministic,
        varlen=varlen,
        bias=bias,
        grad_bias=grad_bias,
        dropout=dropout,
        carry_dq=carry,
        dq_ready=not seqused and _overlaps_convert(schedule, mask_type, deterministic, -(-rows_k // tiles.tile_n)),
        store_first=first,
        zero_ahead=_zeroes_ahead(
            schedule,
            first,
            -(-rows_k // tiles.tile_n),
            ctas,
            group * -(-rows_q // tiles.tile_m),
            reached=not window and (mask_type != 2 or rows_q <= rows_k),
        ),
        tail_m=_tail_m(tiles, schedule, rows_q, per_seq, bias, dropout),
        rng_on_device=rng_on_device,
        softcap=softcap,
        seqused=seqused,
    )
    return tiles, schedule, key


def benchmark_configurations(cases, arch: str) -> list:
    """The compile keys of ``compiled`` the benchmark suites' sm90 backward runs, each once:
    ((B, H, S, D), dtype, causal[, features]), features ':'-joined: ``attention_bwd``'s "bias",
    "bias_grad", "dropout"; the attention suites' ``kv<N>`` (the group), ``dv<N>``,
    ``window<N>``, ``softcap<N>``, and ``sink`` / ``dlse`` (keyed alike: the sink only changes
    the LSE, dLSE enters the preprocess). Head dims of the path; none for varlen cases (the plan
    takes the longest sequence, which the case does not name) or an arch other than sm_90a (the
    path does not run there)."""
    if arch != "sm_90a":
        return []
    # the persistent grid of the GPU the suite runs on (without one, the H100's)
    ctas = PERSISTENT_CTAS or (cc.num_sms(torch.cuda.current_device()) if torch.cuda.is_available() else H100_SMS)
    keys = set()
    for (_, h, s, d), dtype_name, causal, *feature in cases:
        f = _case_features(feature[0] if feature else None, h, d)
        if f is None or bwd_config.head_dims_unsupported(d, f["dv"]) is not None:
            continue
        # as attention_backward_sm90 calls it: causal is top-left, no determinism
        keys.add(
            _plan(
                cc.cute_dtype(getattr(torch, dtype_name)),
                d,
                f["dv"],
                1 if causal else 0,
                arch,
                window=f["window"],
                deterministic=False,
                varlen=False,
                bias=f["bias"],
                grad_bias=f["grad_bias"],
                dropout=f["dropout"],
                rows_q=s,
                group=f["group"],
                rows_k=s,
                ctas=ctas,
                softcap=f["softcap"],
            )[2]
        )
    return sorted(keys, key=str)


def _case_features(feature: Optional[str], heads: int, head_dim: int) -> Optional[dict]:
    """What a benchmark case's features (``benchmark_configurations``) set in the plan; None
    for a varlen case."""
    tokens = feature.split(":") if feature else []
    if "varlen" in tokens:
        return None
    f = dict(dv=head_dim, group=1, window=False, softcap=False, bias=False, grad_bias=False, dropout=False)
    for t in tokens:
        kind = t.rstrip("0123456789")
        number = t[len(kind) :]
        if t in ("bias", "bias_grad", "dropout"):
            f.update(bias=t != "dropout", grad_bias=t == "bias_grad", dropout=t == "dropout")
        elif kind in ("dv", "kv") and number:
            f.update({"dv": int(number)} if kind == "dv" else {"group": heads // int(number)})
        elif kind in ("window", "softcap") and number:
            f[kind] = True
        elif t not in ("sink", "dlse"):
            raise ValueError(f"unknown benchmark case feature {t!r}")
    return f


def compile_for_benchmark_cases(cases, arch: str) -> int:
    """Compile ``benchmark_configurations(cases, arch)``; the count compiled."""
    keys = benchmark_configurations(cases, arch)
    for key in keys:
        compiled(key)
    return len(keys)


_verdicts = Memo()  # unsupported's answers for plain CUDA tensors at TMA-aligned addresses, by metadata


def unsupported(
    query,
    key,
    value,
    grad_out,
    out,
    *,
    mask_type=0,
    window_size=None,
    bias=None,
    dropout_p=0.0,
    arch=None,
    softcap=0.0,
    grad_bias=False,
) -> Optional[str]:
    """Why the sm90 path cannot take this problem (None: it can). ``softcap`` > 0 with ``grad_bias``:
    the bias gradient is the capped scores', dQ / dK's is times the cap's derivative, and the
    kernel keeps one dS tile.

    ``arch``: the DSL target to judge for; by default the device's, known only for real
    CUDA tensors (no CUDA call for CPU, meta or fake ones: they get a reason). Each call
    checks the addresses; for plain CUDA tensors at aligned ones the rest of the answer is
    remembered by metadata (the whole check costs ~15-30 us of host time)."""
    if softcap > 0.0 and grad_bias:
        return "softcap with a bias gradient (dB is dS of the capped scores, dQ / dK take it times 1 - tanh²)"
    return remembered_verdict(
        _verdicts,
        (query, key, value, grad_out, out),
        (arch, mask_type),
        lambda: _unsupported(query, key, value, grad_out, out, mask_type, arch),
    )


def _unsupported(query, key, value, grad_out, out, mask_type, arch) -> Optional[str]:
    """unsupported's checks, all of them."""
    arch = arch or cc.tensor_arch(query)
    if arch != "sm_90a":
        return f"needs sm_90a, the device is {arch or f'{query.device} (no CUDA arch known)'}"
    if query.dtype not in DTYPES:
        return f"dtype {query.dtype} (fp16 / bf16 only)"
    d, dv = query.shape[-1], value.shape[-1]
    why = bwd_config.head_dims_unsupported(d, dv)
    if why is not None:
        return f"head dims {d} / {dv} ({why})"
    if key.shape[2] == 0 or query.shape[2] % key.shape[2]:
        return f"query heads {query.shape[2]} not a multiple of key heads {key.shape[2]}"
    if mask_type not in (0, 1, 2):
        return f"mask type {mask_type}"
    return tma_misaligned((("query", query), ("key", key), ("value", value), ("grad_out", grad_out), ("out", out)))


def _heads_per_chunk(
    tiles,
    rows_q: int,
    rows_k: int,
    group: int,
    pairs: int,
    query: Tensor,
    mask_type: int,
    window: int,
    deterministic: bool,
    varlen: bool,
) -> int:
    """The heavy-first order's chunk (the kernel's ``heads_per_chunk``; unused without a causal
    mask or in deterministic mode). With variable lengths the key blocks' work depends on
    lengths the host does not read: the chunk that fits L2, as before the model (also for a
    tensor off CUDA, whose multiprocessors the model cannot count)."""
    elem = query.element_size()
    if mask_type == 0 or deterministic or varlen or query.device.type != "cuda":
        return tiles.lpt_heads_per_chunk(rows_q, group, elem)
    return tiles.lpt_heads_per_chunk(
        rows_q,
        group,
        elem,
        seqlen_k=rows_k,
        pairs=pairs,
        mask_type=mask_type,
        window=window,
        num_sms=cc.num_sms(query.device.index),
    )


# persistent CTAs (AttentionBackwardSm90.tile_schedule: the d64 tiles without varlen,
# determinism, bias or dropout): how many; None for one per multiprocessor. Tests set a small
# count so that every CTA walks several tiles.
PERSISTENT_CTAS: Optional[int] = None
H100_SMS = 132  # (compile_for_benchmark_cases without a GPU)


def _persistent_ctas(query: Tensor) -> int:
    """The persistent kernel's grid: PERSISTENT_CTAS, else the device's multiprocessors (1 off
    a GPU, where the call only reaches a stand-in for the kernel)."""
    if PERSISTENT_CTAS is not None:
        return PERSISTENT_CTAS
    return cc.num_sms(query.device.index) if query.device.type == "cuda" else 1


def _unzeroed_dq_accum(dq_accum: Tensor) -> Tensor:
    """The fp32 dQ accumulator a ``store_first`` or ``zero_ahead`` kernel gets: as allocated,
    not zeroed (tests fill it with NaN)."""
    return dq_accum


def attention_backward_sm90(args: AttentionBackwardArgs):
    """(dq, dk, dv, grad_bias, grad_sink) of dropout(softmax(scale Q K^T [+ bias] [+ causal mask [+ window]])) V;
    tensors [B, S, H, D] (key / value / dk / dv [B, S, Hk, D] with grouped-query heads: H a
    multiple of Hk; value, out, grad_out and dv have the head dim Dv, which may differ from
    query's and key's).
    ``window_size`` > 0 (with a causal mask): key k sees query q when
    q + offset - window_size < k <= q + offset, as the memory-efficient kernel.

    ``logsumexp``: the forward's natural-log row statistics [B, H, >= Sq] fp32. The caller
    has checked ``unsupported(...) is None``. ``deterministic``: dQ's fp32 sums in a fixed
    order (the same bits from run to run; a zeroed semaphore per query block, and key
    blocks wait for their turn).

    Variable lengths (the memory-efficient op's convention): B == 1, sequence i is rows
    cu_seqlens_q[i] .. cu_seqlens_q[i + 1] (keys alike) of the packed tensors, bounded by
    ``max_seqlen_q / _k``; logsumexp [sequences, H, >= max_seqlen_q]. Masks are per sequence.

    ``bias``: broadcastable to [B, H, Sq, Sk] (not with variable lengths); with
    ``bias_requires_grad`` grad_bias is [B, H, Sq, Sk] (rows padded to 128 bits, as torch's),
    else None. Dropout: the keep mask of torch's memory-efficient forward for
    ``philox_seed / philox_offset`` (int64 scalar tensors), p = ``dropout_p``.

    ``seqused_q / _k`` (int32 [sequences], both or neither): each sequence's used lengths (not
    with a bias or dropout); the padding rows get dQ / dK / dV 0.

    ``sink`` ([H]; the forward's learnable sink, in every row's LSE): grad_sink in its dtype,
    the sum of the row terms that the preprocess writes beside Δ; else None."""
    a = args
    if a.bias is not None and a.varlen:
        raise NotImplementedError("attention bias with cu_seqlens is not supported (torch's forward refuses it too)")
    if a.seqused and (a.bias is not None or a.dropout):
        raise NotImplementedError("used lengths (seqused_q / seqused_k) with an attention bias or dropout")
    plan = _call_plan_of(a)
    b, sq, h, d = a.query.shape
    sk = a.key.shape[1]
    # fresh [B, S, H, D] tensors whatever the inputs' strides, as aten's backward (and the
    # fake implementation of the op that calls this) allocates them
    # (used lengths: the row-predicated stores leave the padding rows, zeros)
    alloc = torch.zeros if a.seqused else torch.empty
    dk = alloc(a.key.shape, dtype=a.key.dtype, device=a.key.device)
    dv = alloc(a.value.shape, dtype=a.value.dtype, device=a.value.device)
    bias = grad_bias = None
    if a.bias is not None:
        bias = a.bias.expand(b, h, sq, sk)  # a view: broadcast dims get stride 0
        if a.bias_requires_grad:  # blocks no key block visits (masks, windows) stay zero
            grad_bias = grad_bias_buffer(a.query, sk, a.custom_mask_type)
    if plan.empty:
        if grad_bias is not None:
            grad_bias.zero_()
        return torch.zeros_like(a.query), dk.zero_(), dv.zero_(), grad_bias, _zero_sink_grad(a.sink)
    fn = compiled(plan.config)
    # whatever touches the stream goes before the preprocess: the kernel is launched right
    # behind it (programmatic dependent launch)
    s = _scratch(plan, a.query.device)
    rng = (None,) * 5
    if a.dropout:  # host seed / offset as values, device ones as tensors the kernel reads
        rng = cc.dropout_args(a.dropout_p, a.philox_seed, a.philox_offset, plan.rows_q, plan.rows_k)
    dq_accum = s.dq_accum
    if plan.unzeroed:  # every block's first dQ is stored there, or the kernel zeroes it
        dq_accum = _unzeroed_dq_accum(dq_accum)
    elif not plan.scratch.fused_zeroing:  # the preprocess clears out's width (Dv): Dqk's apart
        dq_accum.zero_()
    _preprocess(a, s.delta, dq_accum if plan.scratch.fused_zeroing else None, s.lse_log2, s.sink_terms)
    fn(
        a.query,
        a.key,
        a.value,
        a.grad_out,
        s.lse_log2,
        s.delta,
        dq_accum.unsqueeze(0) if a.varlen else dq_accum,
        dk,
        dv,
        s.semaphore,
        s.counter,
        s.ready[1] if s.ready else None,
        s.first,
        a.cu_seqlens_q,
        a.cu_seqlens_k,
        bias,
        grad_bias,
        float(a.scale),
        a.window,
        plan.rows_k,
        plan.chunk,
        plan.ctas,
        float(a.softcap),
        a.seqused_q,
        a.seqused_k,
        *rng,
    )
    dq = P.convert_dq(
        dq_accum, float(a.scale), d, sq, a.cu_seqlens_q, a.max_seqlen_q, 0.0, a.query.dtype, ready=s.ready
    )
    grad_sink = None if a.sink is None else s.sink_terms.sum((0, 2)).to(a.sink.dtype)
    return (dq.unsqueeze(0) if a.varlen else dq), dk, dv, grad_bias, grad_sink


def _zero_sink_grad(sink: Optional[Tensor]) -> Optional[Tensor]:
    return None if sink is None else torch.zeros_like(sink)


def _preprocess(
    a: AttentionBackwardArgs,
    delta: Tensor,
    dq_accum: Optional[Tensor],
    lse_log2: Tensor,
    sink_terms: Optional[Tensor] = None,
) -> None:
    """Δ from out / dO (Dv wide; the pre / postprocess take packed sequences as [total, H, D]),
    ``dq_accum`` zeroed where given, the LSE in the kernel's log2 units, with a loss on the LSE
    Δ - dLSE, with a sink its gradient's row terms into ``sink_terms`` (shaped as Δ): one
    launch. Then Δ := 0 in the rows that see no key (O may be unwritten there; their LSE is a
    constant 0, so dLSE gives them nothing; the sink's terms are taken before, from the real Δ)."""
    out, grad_out = (a.out[0], a.grad_out[0]) if a.varlen else (a.out, a.grad_out)
    sink = None
    if a.sink is not None:  # (before the launch: the kernel follows it by programmatic dependent launch)
        sink = a.sink.float().contiguous()
    P.launch_preprocess(
        out,
        grad_out,
        delta,
        dq_accum,
        1.0,
        a.cu_seqlens_q,
        a.max_seqlen_q,
        a.logsumexp,
        lse_log2,
        a.grad_lse,
        sink,
        sink_terms if sink is not None else None,
    )
    mask, sq, sk = int(a.custom_mask_type), a.query.shape[1], a.key.shape[1]
    P.zero_blind_delta(delta, mask, a.window, sq, sk, a.cu_seqlens_q, a.cu_seqlens_k)
    if a.seqused:  # the padding rows' Δ (dO there is the caller's, dLSE the padding's)
        rows = torch.arange(delta.shape[-1], device=delta.device)
        delta.masked_fill_((rows.view(1, -1) >= a.seqused_q.view(-1, 1)).unsqueeze(1), 0.0)


def _call_plan_of(a: AttentionBackwardArgs) -> _CallPlan:
    """The call's plan, made once per call signature (``_call_plans``)."""
    query, key, value = a.query, a.key, a.value
    rng_dev = a.dropout and cc.rng_on_device(a.philox_seed, a.philox_offset)
    mask, deterministic = int(a.custom_mask_type), bool(a.deterministic)
    bias, grad_bias = a.bias is not None, a.bias is not None and bool(a.bias_requires_grad)
    varlen = (a.cu_seqlens_q.shape, int(a.max_seqlen_q), int(a.max_seqlen_k)) if a.varlen else None
    sig = (query.shape, key.shape, value.shape, query.dtype, query.device, mask, a.window, deterministic, varlen)
    sig += (bias, grad_bias, a.dropout, rng_dev, a.softcap > 0.0, a.seqused, a.sink is not None, _knobs())
    plan = _call_plans.get(sig)
    if plan is None:
        plan = _call_plans.put(
            sig,
            _call_plan(
                query,
                key,
                value,
                mask,
                a.window,
                deterministic,
                a.cu_seqlens_q,
                a.max_seqlen_q,
                a.max_seqlen_k,
                bias,
                grad_bias,
                a.dropout,
                rng_dev,
                a.softcap > 0.0,
                a.seqused,
                a.sink is not None,
            ),
        )
    return plan


class _Scratch(NamedTuple):
    """A call's views of its one fp32 scratch allocation (``_ScratchPlan``); None where absent."""

    delta: Tensor
    lse_log2: Tensor
    dq_accum: Tensor
    semaphore: Optional[Tensor]
    counter: Optional[Tensor]
    ready: Optional[tuple]  # ConvertDQReady's (tile counter, counts, query heads per key head, complete count)
    first: Optional[Tensor]
    sink_terms: Optional[Tensor]


def _scratch(plan: _CallPlan, device) -> _Scratch:
    """One fp32 allocation for what the launches share (each allocation costs 4-8 us of host
    time on an H100 host's CPU), its zeroed int32s zeroed: the persistent CTAs' tile counter
    (schedule "dynamic"; with zero_ahead also the zeroing jobs' counter), ConvertDQReady's tile
    counter and the kernel's counts, the store_first / zero_ahead flags, deterministic mode's
    semaphores."""
    sp = plan.scratch
    scratch = torch.empty(sp.elems, dtype=torch.float32, device=device)
    delta = scratch.as_strided(sp.delta_shape, sp.delta_strides, 0)
    lse_log2 = scratch.as_strided(sp.delta_shape, sp.delta_strides, sp.lse_offset)
    dq_accum = scratch.as_strided(sp.dq_accum_shape, sp.dq_accum_strides, sp.dq_accum_offset)
    sink_terms = None
    if sp.sink_offset is not None:
        sink_terms = scratch.as_strided(sp.delta_shape, sp.delta_strides, sp.sink_offset)
    if not sp.zeroed:
        return _Scratch(delta, lse_log2, dq_accum, None, None, None, None, sink_terms)
    ints = scratch.view(torch.int32)
    ints.as_strided((sp.zeroed,), (1,), sp.flags_offset).zero_()
    counter, tiles, counts, first, semaphore = (
        None if part is None else ints.as_strided(*part) for part in sp.int_parts
    )
    # a head is complete once every key block of the grid (ceil(rows_k / tile_n)) is counted
    ready = None if counts is None else (tiles, counts, *plan.ready_counts)
    return _Scratch(delta, lse_log2, dq_accum, semaphore, counter, ready, first, sink_terms)


class _CallPlan(NamedTuple):
    """What a call decides from its signature alone (``_call_plan``)."""

    config: Optional[Sm90Config]  # the ``compiled`` key (None: nothing to launch)
    empty: bool  # a problem of zero size: zero gradients, no launch
    rows_q: int  # query rows (varlen: max_seqlen_q)
    rows_k: int
    ready_counts: tuple  # ConvertDQReady's (query heads per key head, key blocks of a complete head)
    unzeroed: bool  # the kernel stores each block's first dQ or zeroes the accumulator itself
    chunk: int  # the heavy-first order's heads per chunk
    ctas: int  # the persistent grid
    scratch: "_ScratchPlan"


class _ScratchPlan(NamedTuple):
    """Where a call's fp32 scratch allocation holds its parts (offsets in 4-byte elements,
    each part starting on ``SCRATCH_ALIGN_BYTES``): Δ, the LSE in log2 units and a sink's row
    terms [sequences, H, rows rounded], the zeroed int32s (``int_parts``), the dQ accumulator
    (``attention_bwd_prepost.dq_accum_shape``)."""

    elems: int
    delta_shape: tuple
    delta_strides: tuple
    lse_offset: int
    sink_offset: Optional[int]  # a learnable sink's row terms, shaped as Δ (None: no sink)
    flags_offset: int
    zeroed: int  # int32s to zero
    # (shape, strides, offset) of the int32 parts, None where absent: the tile counter(s),
    # ConvertDQReady's tile counter, its counts [sequences, Hk], the store_first / zero_ahead
    # flags [B, H, query blocks], deterministic mode's semaphores [sequences, H, query blocks]
    int_parts: tuple
    dq_accum_shape: tuple
    dq_accum_strides: tuple
    dq_accum_offset: int
    fused_zeroing: bool  # the preprocess zeroes the accumulator (not unzeroed, Dqk and Dv rounded alike)


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _scratch_plan(
    seqs: int,
    h: int,
    rows_q: int,
    dq_accum_shape: tuple,
    int_shapes: tuple,
    fused_zeroing: bool,
    sink: bool = False,
) -> _ScratchPlan:
    """``int_shapes``: the zeroed int32 parts' shapes in ``_ScratchPlan.int_parts``' order, None
    where absent; ``sink``: a part shaped as Δ for a learnable sink's row terms."""
    align = bwd_config.SCRATCH_ALIGN_BYTES // 4  # fp32 / int32 elements
    up = lambda n: round_up(n, align)  # noqa: E731
    delta_shape = P.delta_shape(seqs, h, rows_q)
    n_delta = up(math.prod(delta_shape))
    flags_offset = offset = (3 if sink else 2) * n_delta
    int_parts = []
    for shape in int_shapes:
        int_parts.append(None if shape is None else (shape, _contiguous_strides(shape), offset))
        offset += 0 if shape is None else math.prod(shape)
    zeroed = offset - flags_offset
    dq_offset = flags_offset + up(zeroed)
    return _ScratchPlan(
        elems=dq_offset + math.prod(dq_accum_shape),
        delta_shape=delta_shape,
        delta_strides=_contiguous_strides(delta_shape),
        lse_offset=n_delta,
        sink_offset=2 * n_delta if sink else None,
        flags_offset=flags_offset,
        zeroed=zeroed,
        int_parts=tuple(int_parts),
        dq_accum_shape=dq_accum_shape,
        dq_accum_strides=_contiguous_strides(dq_accum_shape),
        dq_accum_offset=dq_offset,
        fused_zeroing=fused_zeroing,
    )


_call_plans = Memo()  # by call signature (attention_backward_sm90)


def _knobs() -> tuple:
    """The module-level settings a call plan depends on (tests and experiments change them;
    a changed one makes new plans)."""
    return (
        PERSISTENT_CTAS,
        DQ_READY,
        STORE_FIRST,
        ZERO_AHEAD,
        ZERO_AHEAD_CAUSAL,
        TAIL_BLOCK,
        _tiles,
        _zeroes_ahead,
        bwd_config.attention_sm90_tiles,
        bwd_config.CARRY_DQ_MAX_STEPS,
        bwd_config.DQ_READY_MAX_KEY_BLOCKS,
        bwd_config.ZERO_AHEAD_MAX_STEPS,
    )


def _call_plan(
    query,
    key,
    value,
    mask_type: int,
    window: int,
    deterministic: bool,
    cu_seqlens_q,
    max_seqlen_q,
    max_seqlen_k,
    bias: bool,
    grad_bias: bool,
    dropout: bool,
    rng_dev: bool = False,
    softcap: bool = False,
    seqused: bool = False,
    sink: bool = False,
) -> _CallPlan:
    varlen = cu_seqlens_q is not None
    b, sq, h, d = query.shape
    sk, hk, d_v = key.shape[1], key.shape[2], value.shape[-1]
    seqs = cu_seqlens_q.numel() - 1 if varlen else b
    rows_q = int(max_seqlen_q) if varlen else sq
    rows_k = int(max_seqlen_k) if varlen else sk
    if min(seqs, h, sq, sk, rows_q, rows_k) == 0:  # nothing to launch
        return _CallPlan(None, True, rows_q, rows_k, (), False, 0, 0, None)
    ctas = _persistent_ctas(query)  # the persistent grid (also decides zero_ahead)
    tiles, schedule, config = _plan(
        cc.cute_dtype(query.dtype),
        d,
        d_v,
        mask_type,
        cc.device_arch(query.device.index),
        window=window > 0,
        deterministic=deterministic,
        varlen=varlen,
        bias=bias,
        grad_bias=grad_bias,
        dropout=dropout,
        rows_q=rows_q,
        group=h // hk,
        rows_k=rows_k,
        ctas=ctas,
        rng_on_device=rng_dev,
        softcap=softcap,
        seqused=seqused,
    )
    # the kernel counts dQ's key blocks for ConvertDQReady; it stores each query block's first dQ,
    # or zeroes the accumulator itself (either way the preprocess does not)
    dq_ready, store_first, zero_ahead = config.dq_ready, config.store_first, config.zero_ahead
    unzeroed = store_first or zero_ahead
    blocks_q = -(-rows_q // tiles.tile_m)
    int_shapes = (
        ((2 if zero_ahead else 1),) if schedule == "dynamic" else None,
        (1,) if dq_ready else None,
        (seqs, hk) if dq_ready else None,
        (b, h, blocks_q) if unzeroed else None,
        (seqs, h, blocks_q) if deterministic else None,
    )
    # the accumulator as the preprocess would size it (packed sequences: their total rows)
    dq_accum_shape = P.dq_accum_shape(seqs, sq, h, d, varlen=varlen)
    fused_zeroing = not unzeroed and P.clears_dq_accum(d_v, d)
    scratch = _scratch_plan(seqs, h, rows_q, dq_accum_shape, int_shapes, fused_zeroing, sink)
    return _CallPlan(
        config=config,
        empty=False,
        rows_q=rows_q,
        rows_k=rows_k,
        ready_counts=(h // hk, -(-rows_k // tiles.tile_n)),
        unzeroed=unzeroed,
        chunk=_heads_per_chunk(
            tiles, rows_q, rows_k, h // hk, seqs * hk, query, mask_type, window, deterministic, varlen or seqused
        ),
        ctas=ctas,
        scratch=scratch,
    )
