"""CPU: the grouped arguments of the attention kernels (frozen dataclasses the DSL passes into a
``@cute.kernel`` field by field) and the shared dropout and bias helpers' arithmetic against
plain-Python models."""

import dataclasses
import json
import pathlib
import random
import subprocess
import sys

import pytest
from cutlass.base_dsl.runtime.jit_arg_adapters import JitArgAdapterRegistry

from cute_kernels.attention.dropout import PhiloxArgs, PhiloxStream
from cute_kernels.attention.seqlen_info import Rows
from cute_kernels.attention_sm90.arguments import (
    Carry,
    DkvOut,
    DkvTma,
    DqFirst,
    Features,
    GradBiasTma,
    LoadArgs,
    MmaArgs,
    StoreArgs,
    Work,
)
from cute_kernels.attention_sm90.operands import StepEnv, StepOperands

KERNEL_ARGS = (DqFirst, DkvTma, GradBiasTma, PhiloxArgs)
GROUPED = KERNEL_ARGS + (PhiloxStream, Rows, Carry, DkvOut, Features, LoadArgs, MmaArgs, StoreArgs, Work)


def _blank(cls):
    return cls(*(None for _ in dataclasses.fields(cls)))


@pytest.mark.parametrize("cls", GROUPED + (StepEnv, StepOperands), ids=lambda c: c.__name__)
def test_grouped_arguments_are_frozen(cls):
    x = _blank(cls)
    name = dataclasses.fields(cls)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(x, name, 1)
    with pytest.raises(TypeError):  # no positional unpacking: not iterable
        iter(x)


@pytest.mark.parametrize("cls", KERNEL_ARGS, ids=lambda c: c.__name__)
def test_kernel_arguments_take_the_dsl_dataclass_adapter(cls):
    # the kernel's parameters follow the fields' order: unused fields (None) add none
    assert JitArgAdapterRegistry.get_registered_adapter(_blank(cls)) is not None


def test_kernel_argument_field_order():
    # the order the kernel's parameters take (PTX identity with the tuples these replaced)
    assert [f.name for f in dataclasses.fields(DqFirst)] == ["flags", "tma_store", "accum"]
    assert [f.name for f in dataclasses.fields(DkvTma)] == ["tma_dK", "gdK", "tma_dV", "gdV"]
    assert [f.name for f in dataclasses.fields(GradBiasTma)] == ["atom", "coords"]
    assert [f.name for f in dataclasses.fields(PhiloxArgs)] == ["seed", "offset", "p", "scale", "bh_elems"]


def test_work_steps():
    assert Work(head_kv=1, group=3, m_min=2, m_max=7, rot=0).steps == 15
    assert Work(head_kv=0, group=4, m_min=5, m_max=5, rot=0).steps == 0


# the jit bodies run as plain Python in a fresh interpreter (see test_attention_shared_cpu.py),
# with the compile-time loop and the tensor queries they use mapped onto Python's
_HELPERS = """
import json, sys
import cutlass
import cutlass.cute as cute
cutlass.range_constexpr = range
cutlass.min = min
cute.size = lambda x, mode: len(x) if mode == [0] else len(x[0])
from cutlass import Uint32
from cute_kernels.attention.bias import load_bias_fragment
from cute_kernels.attention.dropout import flag_byte, flag_half

class Grid:  # [r][c] lists indexed as x[r, c]
    def __init__(self, rows):
        self.rows = rows
    def __len__(self):
        return len(self.rows)
    def __getitem__(self, rc):
        if isinstance(rc, int):
            return self.rows[rc]
        return self.rows[rc[0]][rc[1]]
    def __setitem__(self, rc, v):
        self.rows[rc[0]][rc[1]] = v

case = json.loads(sys.argv[1])
halves = [[int(flag_half.__wrapped__([Uint32(f) for f in flags], h)) for h in range(len(flags) // 4)]
          for flags in case["flags"]]
bytes_ = [[int(flag_byte.__wrapped__([Uint32(f) for f in flags], b)) for b in range(len(flags) // 2)]
          for flags in case["flags"]]
loaded = []
for b in case["bias"]:
    B = Grid([[None] * b["cols"] for _ in range(b["rows"])])
    coords = Grid([[tuple(rc) for rc in row] for row in b["coords"]])
    load_bias_fragment.__wrapped__(Grid(b["gB"]), B, coords, b["q0"], b["key0"], b["sq"], b["sk"], b["keys_as_rows"])
    loaded.append(B.rows)
print(json.dumps({"halves": halves, "bytes": bytes_, "bias": loaded}))
"""


def _bias_case(rng, keys_as_rows):
    sq, sk, rows, cols = rng.randint(1, 9), rng.randint(1, 9), 3, 4
    gB = [[rng.randint(-99, 99) for _ in range(sk)] for _ in range(sq)]
    q0, key0 = rng.randint(0, 8), rng.randint(0, 8)
    # coordinates as a fragment's: (key, query) with keys as rows (a backward's S^T), else (query, key)
    qs, ks = rng.sample(range(8), cols if keys_as_rows else rows), rng.sample(range(8), rows if keys_as_rows else cols)
    if keys_as_rows:
        coords = [[(ks[r], qs[c]) for c in range(cols)] for r in range(rows)]
    else:
        coords = [[(qs[r], ks[c]) for c in range(cols)] for r in range(rows)]
    return dict(gB=gB, q0=q0, key0=key0, sq=sq, sk=sk, rows=rows, cols=cols, coords=coords, keys_as_rows=keys_as_rows)


def _bias_model(b):
    out = []
    for row in b["coords"]:
        out.append([])
        for a, c in row:
            q, k = (c, a) if b["keys_as_rows"] else (a, c)
            out[-1].append(b["gB"][min(b["q0"] + q, b["sq"] - 1)][min(b["key0"] + k, b["sk"] - 1)])
    return out


def test_dropout_flag_halves_bytes_and_bias_fragment():
    rng = random.Random(0)
    # keep_flags' quads: flag j of 4 consecutive keys in byte j
    flags = [[sum(rng.getrandbits(1) << (8 * j) for j in range(4)) for _ in range(8)] for _ in range(20)]
    bias = [_bias_case(rng, keys_as_rows) for keys_as_rows in (True, False) for _ in range(10)]
    root = pathlib.Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", _HELPERS, json.dumps(dict(flags=flags, bias=bias))],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    )
    got = json.loads(done.stdout)
    assert len(got["halves"]) == len(flags) and len(got["bias"]) == len(bias)
    for quads, halves in zip(flags, got["halves"]):
        keys = [(quad >> (8 * j)) & 1 for quad in quads for j in range(4)]
        assert halves == [sum(keys[16 * h + j] << j for j in range(16)) for h in range(len(quads) // 4)]
    for quads, bytes_ in zip(flags, got["bytes"]):
        keys = [(quad >> (8 * j)) & 1 for quad in quads for j in range(4)]
        assert bytes_ == [sum(keys[8 * b + j] << j for j in range(8)) for b in range(len(quads) // 2)]
    for b, loaded in zip(bias, got["bias"]):
        assert loaded == _bias_model(b)
