"""ops._validate.kernel_ready: the gradients autograd hands a backward pass through where a kernel
can read them (last dim contiguous, no broadcast dim, strides and address multiples of the vector),
and become dense copies otherwise."""

import torch

from ops._validate import kernel_ready


def _readable(t, vec):
    outer = [s for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1]
    return t.stride(-1) == 1 and t.data_ptr() % (vec * t.element_size()) == 0 and all(s and s % vec == 0 for s in outer)


def test_readable_tensors_pass_through():
    x = torch.randn(2, 5, 3, 16, dtype=torch.bfloat16)
    sliced = torch.randn(2, 5, 3, 32, dtype=torch.bfloat16)[..., :16]  # rows 32 apart
    heads_first = x.transpose(1, 2)  # last dim contiguous, every other stride a multiple of 16
    for t in (x, sliced, heads_first, x[:0]):
        assert kernel_ready(t, 8) is t


def test_unreadable_layouts_become_dense_copies():
    for t in (
        torch.ones((), dtype=torch.bfloat16).expand(2, 5, 3, 16),  # .sum()'s gradient: every stride 0
        torch.randn(2, 5, 3, 32, dtype=torch.bfloat16)[..., ::2],  # the last dim strided
        torch.randn(2, 5, 3, 20, dtype=torch.bfloat16)[..., :16],  # rows 20 apart: not a multiple of 8
        torch.randn(2 * 5 * 3 * 16 + 1, dtype=torch.bfloat16)[1:].view(2, 5, 3, 16),  # one element off alignment
    ):
        assert not _readable(t, 8)
        got = kernel_ready(t, 8)
        assert got is not t and got.is_contiguous() and _readable(got, 8) and torch.equal(got, t)


def test_dense_rows_shorter_than_the_vector_rule():
    # contiguous rows of 12 elements: 12 is no multiple of 8, so the fast path does not apply and the
    # strides decide; a dense copy could not do better, so the tensor comes back as it is
    t = torch.randn(4, 12, dtype=torch.bfloat16)
    assert kernel_ready(t, 1) is t and kernel_ready(t, 8) is t and kernel_ready(t, 4) is t
