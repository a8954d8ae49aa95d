"""Host-side integer helpers of the Triton launchers.

``triton.cdiv`` is a ``@triton.jit`` function in recent Triton: called from Python it goes
through the JIT's call path (~2 us a call, several per launch plan); these are plain ints.
"""


def cdiv(numerator: int, denominator: int) -> int:
    """ceil(numerator / denominator) for non-negative ints."""
    return -(-numerator // denominator)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), as triton.next_power_of_2."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
