"""Every public op refuses bad inputs with a clear error naming the argument, before any launch.

One table per op in ``ops.__all__`` (tests/test_bad_inputs_{dropout_bias,norm,prepost,attention}_cpu.py,
by op family; this file checks that they cover every op): wrong device, dtype, rank, shapes
that disagree, layouts the kernels cannot read, head dims over the limit, probabilities
outside [0, 1), malformed cu_seqlens, empty tensors where they are not allowed, wrong weight
shapes... Each case changes one thing in inputs that pass validation (``GOOD`` shows
that they do), so it fails for its own reason.

The CUDA tensors are FakeTensorMode tensors on device "cuda": validation sees real
metadata, nothing runs, and the cases run on CPU-only machines. Cases that need real
values or addresses (cu_seqlens contents, misaligned pointers) are marked ``gpu``.

"Before any launch" is enforced, not hoped for (the guard of tests/bad_inputs_common.py):
while a case runs, the compile caches, every launch through a memoised launch plan (whose
compiled functions skip the compile caches once cached) and each op's first step after
validation (its custom op, its implementation, torch's forward for the autograd ops) raise
``_Reached`` instead, which no case expects.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import ops
import ops.attention_bwd_prepost as P
import ops.dropout_bias as D
import ops.norm as N
import ops.norm_forward as NF
from ops import _compile as cc

from .bad_inputs_common import (
    BF16,
    I32,
    _guard,
    _Reached,
    _reached,
    bd,
    db_bits,
    dbf,
    bias_dropout_module,
    cdkv,
    cdq,
    cpa,
    cdq_var,
    clr,
    db,
    db_act,
    delta,
    delta_var,
    eab,
    eab_var,
    layer_norm_module,
    ln,
    lnb,
    mea,
    mea_var,
    pre,
    pre_var,
    rms_norm_module,
    rn,
    rnb,
    sdpa_enter,
)
from .test_bad_inputs_attention_backward_cpu import EFFICIENT_ATTENTION_BACKWARD
from .test_bad_inputs_attention_cpu import (
    EFFICIENT_ATTENTION_FORWARD,
    MEMORY_EFFICIENT_ATTENTION,
    USE_FOR_SDPA,
)
from .test_bad_inputs_context_parallel_cpu import CONTEXT_PARALLEL_ATTENTION
from .test_bad_inputs_dropout_bias_cpu import (
    BIAS_DROPOUT,
    BIAS_DROPOUT_MODULE,
    DROPOUT_BIAS_BACKWARD,
    DROPOUT_BIAS_FORWARD,
)
from .test_bad_inputs_norm_cpu import (
    DROPOUT_ADD_NORM,
    DROPOUT_ADD_NORM_MODULES,
    LAYER_NORM,
    LAYER_NORM_BACKWARD,
    NORM_MODULES,
    RMS_NORM,
    RMS_NORM_BACKWARD,
)
from .test_bad_inputs_prepost_cpu import CLEAR_DKV_ACCUM, COMPUTE_DELTA, CONVERT_DKV, CONVERT_DQ, PREPROCESS

TABLES = {
    "dropout_bias_backward": DROPOUT_BIAS_BACKWARD,
    "bias_dropout": BIAS_DROPOUT,
    "dropout_bias_forward": DROPOUT_BIAS_FORWARD,
    "BiasDropout": BIAS_DROPOUT_MODULE,
    "layer_norm_backward": LAYER_NORM_BACKWARD,
    "rms_norm_backward": RMS_NORM_BACKWARD,
    "layer_norm": LAYER_NORM,
    "rms_norm": RMS_NORM,
    "norm modules": NORM_MODULES,
    "dropout_add_norm": DROPOUT_ADD_NORM,
    "dropout_add_norm modules": DROPOUT_ADD_NORM_MODULES,
    "attention_bwd_preprocess": PREPROCESS,
    "attention_bwd_compute_delta": COMPUTE_DELTA,
    "attention_bwd_convert_dq": CONVERT_DQ,
    "attention_bwd_convert_dkv": CONVERT_DKV,
    "attention_bwd_clear_dkv_accum": CLEAR_DKV_ACCUM,
    "efficient_attention_backward": EFFICIENT_ATTENTION_BACKWARD,
    "memory_efficient_attention": MEMORY_EFFICIENT_ATTENTION,
    "efficient_attention_forward": EFFICIENT_ATTENTION_FORWARD,
    "use_for_sdpa": USE_FOR_SDPA,
    "context_parallel_attention": CONTEXT_PARALLEL_ATTENTION,
}
BAD = [p for table in TABLES.values() for p in table]


GOOD = [
    ("dropout_bias_backward", db),
    ("dropout_bias_backward", db_act),
    ("dropout_bias_backward", db_bits),
    ("bias_dropout", bd),
    ("dropout_bias_forward", dbf),
    ("BiasDropout", bias_dropout_module),
    ("layer_norm_backward", lnb),
    ("rms_norm_backward", rnb),
    ("layer_norm", ln),
    ("rms_norm", rn),
    ("LayerNorm", layer_norm_module),
    ("RMSNorm", rms_norm_module),
    ("attention_bwd_preprocess", pre),
    ("attention_bwd_preprocess", pre_var),
    ("attention_bwd_compute_delta", delta),
    ("attention_bwd_compute_delta", delta_var),
    ("attention_bwd_convert_dq", cdq),
    ("attention_bwd_convert_dq", cdq_var),
    ("attention_bwd_convert_dkv", cdkv),
    ("attention_bwd_clear_dkv_accum", clr),
    ("efficient_attention_backward", eab),
    ("efficient_attention_backward", eab_var),
    ("memory_efficient_attention", mea),
    ("memory_efficient_attention", mea_var),
    ("context_parallel_attention", cpa),
    ("use_for_sdpa", sdpa_enter),
    ("use_for_sdpa", lambda: lambda: ops.use_for_sdpa.enable("CPU")),
]


@pytest.mark.parametrize("op,build", GOOD, ids=[f"{op}/{i}" for i, (op, _) in enumerate(GOOD)])
def test_base_inputs_pass_validation(op, build, monkeypatch):
    """The inputs every bad case starts from reach the launch path: each case fails for its own fault.

    Without grad: autograd on fake CUDA parameters aborts a CPU-only torch build (validation is
    the same either way)."""
    _guard(monkeypatch, op)
    with pytest.raises(_Reached):
        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
            build()()


def _cpu_launches():
    """(op, launch) pairs that run a kernel through each kind of memoised plan, on CPU tensors
    (the plan makers only read metadata and addresses; a stand-in takes the compiled
    function's place)."""
    acc = lambda: torch.zeros(1, 1, 128, 64)  # noqa: E731
    dk_accum, dv_accum, dk, dv = (
        acc(),
        acc(),
        torch.empty(1, 77, 1, 64, dtype=BF16),
        torch.empty(1, 77, 1, 64, dtype=BF16),
    )
    dy, mask, dx, dbias = (
        torch.ones(4, 8, dtype=BF16),
        torch.ones(4, 8, dtype=torch.uint8),
        torch.empty(4, 8, dtype=BF16),
        torch.empty(8, dtype=BF16),
    )
    x, w, stat, dw = torch.ones(4, 8, dtype=BF16), torch.ones(8), torch.ones(4), torch.empty(8)
    return [
        ("attention_bwd_clear_dkv_accum", lambda: P.launch_clear_dkv_accum(dk_accum, dv_accum)),  # a bare function
        (
            "attention_bwd_convert_dkv",
            lambda: P.launch_convert_dkv(dk_accum, dv_accum, dk, dv, 0.125, 1.0, None),
        ),  # a tuple
        ("dropout_bias_backward", lambda: D.launch(dy, mask, 0.1, None, None, None, dx, dbias)),  # a _Plan
        (
            "dropout_bias_backward",
            lambda: D.launch(dy, mask[:, :1], 0.1, None, None, None, dx, dbias, True),
        ),  # the bit mask's _Plan
        (
            "layer_norm_backward",
            lambda: N.launch(dy, x, w, stat, stat, None, False, dx, dw, None),
        ),  # a _Plan, finalize too
        ("layer_norm", lambda: NF.forward(x, w, None, 1e-5, False)),  # the forward's _Plan
    ]


@pytest.mark.parametrize("index", range(len(_cpu_launches())), ids=[op for op, _ in _cpu_launches()])
def test_guard_catches_a_launch_through_a_cached_plan(index, monkeypatch):
    """A plan cached before the guard holds a compiled function that no compile cache sees
    again: the guard must still stop its launch. Without the plan guard (compile caches
    alone) the same call launches."""
    from ops._memo import Memo

    for module in (P, D, N, NF):  # fresh memos: nothing of this test stays behind in the real ones
        monkeypatch.setattr(module, "_plans", Memo())
    monkeypatch.setattr(cc, "device_arch", lambda index: "sm_90a")  # no driver to ask on CPU
    monkeypatch.setattr(cc, "num_sms", lambda index: 132)
    monkeypatch.setattr(cc, "ticket_counters", lambda device, count: torch.zeros(count, dtype=I32))
    launched = []
    stand_in = lambda *args: launched.append(len(args))  # noqa: E731
    op, launch = _cpu_launches()[index]
    with monkeypatch.context() as warm:  # warm the plan cache: the compile cache hands out the stand-in
        warm.setattr(cc.CompileCache, "__call__", lambda self, *key: stand_in)
        launch()
    assert launched, "the warm-up launched nothing"
    with monkeypatch.context() as compiles_only:  # compile caches guarded alone: the cached plan launches
        compiles_only.setattr(cc, "compile_kernel", _reached("compile_kernel"))
        compiles_only.setattr(cc.CompileCache, "__call__", lambda self, *key: _reached(f"compile cache {self.name}")())
        before = len(launched)
        launch()
        assert len(launched) > before, "the plan was not cached: this test shows nothing"
    before = len(launched)
    _guard(monkeypatch, op, entries=False)
    with pytest.raises(_Reached, match="a launch through"):
        launch()
    assert len(launched) == before, "a kernel launched under the guard"


def test_every_public_op_has_a_table():
    covered = {p.values[0].op for p in BAD}
    assert covered == set(ops.__all__), set(ops.__all__) ^ covered
    for name in ops.__all__:  # several faults per op, most of them checked on CPU
        mine = [p for p in BAD if p.values[0].op == name]
        assert len(mine) >= 4 and sum(not p.values[0].gpu for p in mine) >= 4, name


def test_enough_cases_run_without_a_gpu():
    cpu_cases = [p for p in BAD if not p.values[0].gpu]
    assert len(BAD) >= 60 and len(cpu_cases) >= 50, (len(BAD), len(cpu_cases))
    assert len({p.id for p in BAD}) == len(BAD), "case ids must be unique"
