"""The randomized GPU suite's machinery: hypothesis-driven randomized agreement with the fp64
references, every op family (one file each: tests/test_randomized_{dropout_bias,norm,prepost,
mem_eff,fwd_sm90}_gpu.py).

Families and their cases per run (CASES below, spread evenly over each family's classes
and rounded up: 920 in all; at least 500 is checked by tests/test_randomized_total_gpu.py
when every family's file runs):

* dropout_bias_backward (144, 8 classes): shapes (2-D and 3-D), dtypes, p, activations, bias
  dtypes, bool / uint8 masks, row-strided views of bigger buffers;
* layer_norm_backward / rms_norm_backward (140, 14 classes): rows, N in 1..20000 (odd ones too),
  input / grad / weight dtypes, with and without weight and bias;
* attention_bwd_preprocess + compute_delta (54, 6 classes), convert_dq (40, 5),
  convert_dkv (40, 5):
  batch, heads, lengths, head dims (odd ones too), variable lengths, split partials,
  [B, S, H, D] / [total, H, D] views with permuted and padded strides;
* efficient_attention_backward (144, 6 classes): B, H, Mq, Mk, Dqk != Dv up to 256, fp16 / bf16,
  custom_mask_type 0/1/2, windows, variable lengths, num_splits_key, and q / k / v / out /
  dO that are permuted, padded views of bigger buffers (arbitrary strides);
* efficient_attention_backward with bias / bias gradient / dropout (208, 8 classes): every
  broadcast kind of bias (dense, padded and transposed strides), p, masks, windows, split
  keys, variable lengths with dropout, fp16 / bf16 / fp32, head dims to 256; against the
  fp64 reference with torch's dropout mask (tests/test_mem_eff_attention_features_gpu.py).
* the Hopper attention forward (150, 15 classes; sm_90a): every head-dim pair it compiles,
  fp16 / bf16, masks none / top-left / bottom-right (more queries than keys through the
  kernel's torch face; the ops' NotImplementedError checked), windows, grouped- and
  multi-query heads, odd lengths, variable lengths with empty and one-row sequences (the ops'
  refusal of a bias there checked), bias of every broadcast and layout, dropout, padded and
  permuted views, through the kernel's torch face, efficient_attention_forward,
  memory_efficient_attention and SDPA under use_for_sdpa (a call counter asserts ours ran); O
  and the LSE against the fp64 reference with torch's keep mask for the philox state the call
  took (tests/test_attention_fwd_sm90_gpu.py).

Compile time is bounded by design: every distinct kernel configuration is a JIT compile
(seconds each for the attention backward), so each family draws one of a few fixed
*classes* (the arguments that pick a compiled configuration: dtypes, padded head dim,
vector width, varlen, split / no split, alignment; for the norms the tiles, which depend
on N) and randomizes everything else within the class: one pytest case per class. About
115 configurations in all with the default seed, 6 of them attention-backward kernels and
15 attention forwards (seconds each), the rest small kernels (0.2-1 s each).

Comparisons reuse the existing GPU tests' helpers and tolerances. Outputs are NaN before
the kernels write them: dropout / norm cases launch into poisoned outputs and then call
the public op, asserting it bitwise equal (both deterministic); the attention cases call
the public ops after filling the allocator's blocks of the outputs' sizes with NaN.

Reproducible: hypothesis runs with ``@seed(CUTE_KERNELS_RANDOM_SEED)`` (default below)
and no example database; set the environment variable to draw other cases. A failure
names the seed and the case. Shrinking is off (it would compile new configurations);
``CUTE_KERNELS_SHRINK=1`` turns it on.
"""

import collections
import math
import os

import torch
from hypothesis import HealthCheck, Phase, given, note, seed, settings
from hypothesis import strategies as st

DEV = "cuda"
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32

DEFAULT_SEED = 20240611
SEED = int(os.environ.get("CUTE_KERNELS_RANDOM_SEED", DEFAULT_SEED))
_PHASES = (Phase.explicit, Phase.generate) + ((Phase.shrink,) if os.environ.get("CUTE_KERNELS_SHRINK") == "1" else ())

# cases per family (hypothesis max_examples); the sum must stay >= MIN_TOTAL_CASES
CASES = {
    "dropout_bias": 140,
    "norm": 140,
    "attention_bwd_preprocess": 50,
    "attention_bwd_convert_dq": 40,
    "attention_bwd_convert_dkv": 40,
    "efficient_attention_backward": 140,
    "efficient_attention_backward_bias_dropout": 208,
    "attention_forward": 150,
}
MIN_TOTAL_CASES = 500
assert sum(CASES.values()) >= MIN_TOTAL_CASES

_COUNTS: collections.Counter = collections.Counter()  # cases that ran to the end, per family
_DONE: set = set()  # (family, class) whose hypothesis run completed
_CLASSES: dict = {}  # family -> its classes


def _settings(max_examples):
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=False,  # @seed(SEED) fixes the draw instead
        phases=_PHASES,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
        print_blob=False,
    )


def _run_case(family, spec, fn):
    """Run one case; a failure names the seed and the case."""
    note(f"{family} case (CUTE_KERNELS_RANDOM_SEED={SEED}): {spec}")
    try:
        fn(spec)
    except AssertionError as e:
        raise AssertionError(f"{e}\n[{family}, CUTE_KERNELS_RANDOM_SEED={SEED}, case {spec}]") from e
    _COUNTS[family] += 1


def _family(family, classes, specs, case, seed_per_class=False):
    """The hypothesis run of one family for one class (``ci``): CASES[family] spread evenly
    over the classes, so each compiled configuration gets its share of cases. With
    ``seed_per_class`` each class draws from seed SEED + ci (else all from SEED: classes whose
    strategies match then draw the same sizes)."""
    _CLASSES[family] = classes
    per_class = math.ceil(CASES[family] / len(classes))

    def test(ci):
        @seed(SEED + ci if seed_per_class else SEED)
        @_settings(per_class)
        @given(data=st.data())
        def run(data):
            spec = data.draw(specs(ci), label="case")
            _run_case(family, spec, case)

        run()
        _DONE.add((family, ci))

    return test


def _vec_of_len(n, vmax):
    """The widest power of two <= vmax dividing n (the hosts' vector rule for a row of n)."""
    v = vmax
    while n % v:
        v //= 2
    return v


def _dt(dtype):
    return "none" if dtype is None else str(dtype).replace("torch.", "").replace("float", "f")


def _vmax(dtype):
    return 16 // dtype.itemsize  # 128-bit accesses


def into_padded(vals, pads=None, order=None, offset=0):
    """A copy of ``vals`` as a view into a bigger buffer: dims laid out outer to inner in
    ``order`` (dims other than the last; the last is innermost, stride 1), each dim's extent
    grown by ``pads[d]``, the view starting ``offset`` elements into the buffer. Elements
    outside the view are NaN (floats) or 1 (bool / ints), so a kernel reading them shows."""
    nd = vals.dim()
    pads = list(pads) if pads is not None else [0] * nd
    order = list(order) if order is not None else list(range(nd - 1))
    assert sorted(order) == list(range(nd - 1)), order
    ext = [s + p for s, p in zip(vals.shape, pads)]
    strides, acc = [0] * nd, 1
    for d in [nd - 1] + order[::-1]:
        strides[d] = acc
        acc *= ext[d]
    fill = float("nan") if vals.is_floating_point() else 1
    buf = torch.full((offset + acc,), fill, dtype=vals.dtype, device=vals.device)
    view = buf.as_strided(tuple(vals.shape), tuple(strides), offset)
    view.copy_(vals)
    return view


def _layout(st_pad, st_offset, nd):
    """A strategy of (pads, order, offset) for into_padded of an nd-dim tensor."""
    return st.tuples(
        st.lists(st.integers(0, 2), min_size=nd - 1, max_size=nd - 1),
        st_pad,
        st.permutations(list(range(nd - 1))),
        st_offset,
    ).map(lambda t: (tuple(t[0]) + (t[1],), tuple(t[2]), t[3]))


def _apply_layout(t, layout):
    pads, order, offset = layout
    return into_padded(t, pads, order, offset)


def _lengths(max_len, max_seqs=4):
    """Variable sequence lengths (zeros allowed), at least one row in all."""
    return st.lists(st.integers(0, max_len), min_size=1, max_size=max_seqs).filter(lambda ls: sum(ls) > 0)


def _pad_last(t, extra):
    return t if not extra else into_padded(t, [0] * (t.dim() - 1) + [extra])
