"""Integer helpers that run on host ints and DSL values alike.

Code written with them traces into a kernel (``Int32`` / ``Boolean`` operands) and runs on the
host (Python ints / bools: tests, host-side iteration) from one source. So no Python
``if``/``and``/``or``/``min``/``max`` touches a value that may be dynamic: both branches are
computed and picked with ``select``; Python bools fold, so static flags cost nothing. Divisors
are compile-time Python ints. Users: the memory-efficient attention backward's walk
(``cute_kernels/mem_eff_attention/iteration.py``) and the mask's forms of it
(``AttentionMask.first_query_for_key`` ...).
"""

import cutlass


def is_py(x) -> bool:
    return isinstance(x, (bool, int))


def is_bool(x) -> bool:
    return isinstance(x, (bool, cutlass.Boolean))


def min_(a, b):
    return cutlass.min(a, b)  # Python ints in -> Python int out


def max_(a, b):
    return cutlass.max(a, b)


def select(cond, a, b):
    if isinstance(cond, bool):
        return a if cond else b
    # arith.select needs both operands of one type.
    ty = cutlass.Boolean if is_bool(a) and is_bool(b) else cutlass.Int32
    return ty(cutlass.select_(cond, ty(a), ty(b)))


def and_(a, b):
    # A Python bool on either side is folded, so static flags cost nothing.
    if isinstance(a, bool):
        return b if a else False
    if isinstance(b, bool):
        return a if b else False
    return a & b


def or_(a, b):
    if isinstance(a, bool):
        return True if a else b
    if isinstance(b, bool):
        return True if b else a
    return a | b


def not_(a):
    if isinstance(a, bool):
        return not a
    return cutlass.not_(a)


def cdiv_trunc(a, b: int):
    """C++ ``a / b`` (truncates toward zero) for a positive compile-time ``b``.

    Python ``//`` floors; DSL ``Int32 //`` is ``arith.floordivsi`` (also floors),
    while DSL ``Int32 %`` is ``arith.remsi`` (truncates, unlike Python ``%``).
    """
    if is_py(a):
        q = abs(a) // b
        return q if a >= 0 else -q
    q = a // b
    return select(and_(a < 0, q * b != a), q + 1, q)


def ceil_div(a, b: int):
    return (a + (b - 1)) // b  # a >= 0: floor == trunc


def align_up(a, b: int):
    return ceil_div(a, b) * b
