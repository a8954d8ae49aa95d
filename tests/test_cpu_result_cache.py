"""The C++ ops' CPU result cache (csrc/cpu_result_cache.h, dflash2_kernels.memory).

Results and kernel temporaries of 64 KiB and up take memory kept from freed ones of the
same mapped length (whole pages below 8 MiB, whole 2 MiB huge pages from there); what
is kept stays within DFLASH2_CPU_CACHE_MB; memory of a live tensor (or of a view of
one) is never kept; results written into reused memory are the same as into fresh
memory; a request the system refuses unmaps what is kept and tries again. The sizes
sit at the 64 KiB threshold, at the 8 MiB switch to huge-page lengths and, in the mmap
build, at page and 2 MiB block edges. The suite's sanitized half runs the same tests on
the ASan build, which keeps blocks at their exact size and poisons them while kept.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

import dflash2_kernels as dk
from dflash2_kernels import reference
from dflash2_kernels._extension import EXTENSION_ERROR, has_kernel
from dflash2_kernels.conv import ops  # noqa: F401  (registers the raw ops' fake impls)

from .contract import assert_within_contract

pytestmark = pytest.mark.skipif(
    not has_kernel("conv_forward_cpu", "cpu"),
    reason=f"the C++ extension lacks the conv's CPU kernel (import error: {EXTENSION_ERROR})",
)

MIB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
# The sanitized half of the suite (scripts/asan.py) preloads ASan, whose build keeps
# blocks at their exact size.
SANITIZED = "asan" in os.environ.get("LD_PRELOAD", "")
HIDDEN = 2048  # one fp32 row is 8 KiB: 8 rows are exactly 64 KiB, 1024 rows 8 MiB
GROUP = 16
TAPS = 2
BLOCK = 8


@pytest.fixture(autouse=True)
def _empty_cache(monkeypatch):
    monkeypatch.delenv("DFLASH2_CPU_CACHE_MB", raising=False)
    dk.empty_cpu_cache()
    yield
    dk.empty_cpu_cache()


def conv_inputs(rows: int, seed: int = 0, hidden: int = HIDDEN):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=generator)
    delta = torch.randn(rows, TAPS, hidden // GROUP, generator=generator)
    base = torch.randn(TAPS, hidden, generator=generator)
    return x, delta, base


def conv_forward(x, delta, base):
    """[rows, hidden] float32, a C++ op result of rows * hidden * 4 bytes."""
    return torch.ops.dflash2.conv_forward_cpu(x, delta, base, BLOCK, torch.float32)


def _whole(nbytes: int, unit: int) -> int:
    return -(-nbytes // unit) * unit


@pytest.mark.parametrize(
    "rows, hidden, mapped",
    [
        pytest.param(7, HIDDEN, 0, id="under-64KiB-not-kept"),
        pytest.param(8, HIDDEN, 64 << 10, id="64KiB"),
        pytest.param(9, 2000, _whole(9 * 2000 * 4, PAGE), id="70KiB-not-whole-pages"),
        pytest.param(128, HIDDEN, MIB, id="1MiB"),
        pytest.param(300, 2000, _whole(300 * 2000 * 4, PAGE), id="2.3MiB-not-whole-pages"),
        pytest.param(1023, HIDDEN, 1023 * HIDDEN * 4, id="under-8MiB-whole-pages"),
        pytest.param(1024, HIDDEN, 8 * MIB, id="8MiB"),
        pytest.param(1025, HIDDEN, 10 * MIB, id="8MiB-and-a-row"),
        pytest.param(1280, HIDDEN, 10 * MIB, id="10MiB"),
    ],
)
def test_a_freed_large_result_is_kept_and_reused(rows, hidden, mapped):
    inputs = conv_inputs(rows, hidden=hidden)
    out = conv_forward(*inputs)
    pointer = out.data_ptr()
    assert dk.cpu_cache_bytes() == 0, "memory of a live result was counted as kept"
    del out
    kept = dk.cpu_cache_bytes()
    if mapped and SANITIZED:
        assert kept == rows * hidden * 4
    else:
        assert kept == mapped
    again = conv_forward(*inputs)
    if kept:
        assert again.data_ptr() == pointer
    assert dk.cpu_cache_bytes() == 0


def test_a_result_written_into_reused_memory_is_the_fresh_result(monkeypatch):
    # Poisoning would overwrite the stale contents this test needs to leave in place.
    monkeypatch.setenv("DFLASH2_POISON_OUTPUTS", "0")
    first_inputs, second_inputs = conv_inputs(1024, seed=1), conv_inputs(1024, seed=2)
    first = conv_forward(*first_inputs)
    first.fill_(float("nan"))
    del first
    second = conv_forward(*second_inputs)
    expected = reference.grouped_dynamic_conv(*second_inputs, block_size=BLOCK, group_size=GROUP)
    exact = reference.grouped_dynamic_conv(*(t.double() for t in second_inputs), block_size=BLOCK, group_size=GROUP)
    assert_within_contract("conv forward into reused memory", second, expected, exact)


def test_a_view_keeps_its_memory_from_reuse():
    inputs = conv_inputs(1024)
    out = conv_forward(*inputs)
    row = out[3].clone()
    view = out[3]
    del out
    assert dk.cpu_cache_bytes() == 0
    other = conv_forward(*conv_inputs(1024, seed=5))
    assert other.data_ptr() != view.data_ptr() - 3 * HIDDEN * 4
    assert torch.equal(view, row)
    del view
    assert dk.cpu_cache_bytes() == 8 * MIB


@pytest.mark.parametrize(
    "limit_mib, kept_mib",
    [
        pytest.param("0", 0, id="0-keeps-nothing"),
        pytest.param("7", 0, id="below-one-result"),
        pytest.param("12", 8, id="one-of-two"),
        pytest.param("16", 16, id="both"),
    ],
)
def test_what_is_kept_stays_within_the_limit(monkeypatch, limit_mib, kept_mib):
    monkeypatch.setenv("DFLASH2_CPU_CACHE_MB", limit_mib)
    inputs = conv_inputs(1024)
    first, second = conv_forward(*inputs), conv_forward(*inputs)
    del first, second
    assert dk.cpu_cache_bytes() == kept_mib * MIB


@pytest.mark.parametrize("value", ["lots", "-1", "1.5", "12MB"])
def test_a_malformed_limit_is_an_error_naming_it(monkeypatch, value):
    monkeypatch.setenv("DFLASH2_CPU_CACHE_MB", value)
    with pytest.raises(RuntimeError, match="DFLASH2_CPU_CACHE_MB must be a non-negative whole number"):
        conv_forward(*conv_inputs(1024))


def test_empty_cpu_cache_releases_what_is_kept():
    results = [conv_forward(*conv_inputs(1024)) for _ in range(3)]
    del results
    assert dk.cpu_cache_bytes() == 24 * MIB
    dk.empty_cpu_cache()
    assert dk.cpu_cache_bytes() == 0


def test_a_result_can_be_resized():
    inputs = conv_inputs(1024)
    out = conv_forward(*inputs)
    head = out[:4].clone()
    out.resize_(2048, HIDDEN)  # moves the storage to torch's allocator, freeing the block
    assert dk.cpu_cache_bytes() == 8 * MIB
    assert torch.equal(out[:4], head)


def test_threads_taking_and_freeing_results_get_correct_results():
    inputs = conv_inputs(1024)
    expected = conv_forward(*inputs).clone()
    failures = []

    def work():
        for _ in range(8):
            out = conv_forward(*inputs)
            if not torch.equal(out, expected):
                failures.append("wrong result")
            del out

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    assert dk.cpu_cache_bytes() <= 4 * 8 * MIB


def test_a_training_step_reuses_the_dense_unary_gradient():
    """score_candidates' [N, V] dU (8 MiB here) lands in the previous step's memory."""
    rows, vocab, rank, top_k = 512, 4096, 8, 4
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, vocab, generator=generator, requires_grad=True)
    projected = torch.randn(rows, rank, generator=generator, requires_grad=True)
    codebooks = [torch.randn(vocab, rank, generator=generator, requires_grad=True) for _ in range(2)]
    predecessors = torch.randint(0, vocab, (rows,), generator=generator)
    candidates = torch.randint(0, vocab, (rows, top_k), generator=generator)
    weights = torch.randn(rows, top_k, generator=generator)

    def step():
        scores = dk.score_candidates(logits, projected, *codebooks, predecessors, candidates)
        (scores * weights).sum().backward()
        grad = logits.grad
        logits.grad = None
        return grad.data_ptr(), grad.clone()

    first_pointer, first_grad = step()
    second_pointer, second_grad = step()
    assert second_pointer == first_pointer
    assert torch.equal(second_grad, first_grad)


@pytest.mark.parametrize(
    "rows, vocab, rank, top_k",
    [
        pytest.param(512, 1024, 32, 8, id="temporaries-from-64KiB"),
        pytest.param(2048, 4096, 64, 16, id="temporaries-of-MiBs"),
    ],
)
def test_the_selector_backward_keeps_its_temporaries_for_the_next_call(rows, vocab, rank, top_k):
    """Its [N, r] buffers (P * g in float64, the contexts in float32: 128 and 64 KiB in
    the smaller case) are the previous call's blocks."""
    generator = torch.Generator().manual_seed(4)
    projected = torch.randn(rows, rank, generator=generator)
    codebooks = [torch.randn(vocab, rank, generator=generator) for _ in range(2)]
    predecessors = torch.randint(0, vocab, (rows,), generator=generator)
    candidates = torch.randint(0, vocab, (rows, top_k), generator=generator)
    grad = torch.randn(rows, top_k, generator=generator)

    def backward():
        return torch.ops.dflash2.selector_scores_backward(
            grad, projected, *codebooks, predecessors, candidates, True, top_k, torch.float32)

    first = [g.clone() for g in backward()]  # the results' blocks are kept too, once freed
    kept = dk.cpu_cache_bytes()
    # At least P * g ([N, r] float64) and the contexts ([N, r] float32) were kept.
    assert kept >= rows * rank * (8 + 4)
    second = [g.clone() for g in backward()]
    assert dk.cpu_cache_bytes() == kept, "a second call mapped its temporaries afresh"
    for a, b in zip(first, second):
        assert torch.equal(a, b)


REFUSED_REQUEST = """
import resource, sys, torch
import dflash2_kernels as dk
from dflash2_kernels.conv import ops  # noqa: F401
torch.set_num_threads(1)
def result(rows):
    x = torch.zeros(rows, 2048); delta = torch.zeros(rows, 2, 128); base = torch.zeros(2, 2048)
    out = torch.ops.dflash2.conv_forward_cpu(x, delta, base, 8, torch.float32)
    return out.sum().item()
result(8192)  # 64 MiB, kept once freed
assert dk.cpu_cache_bytes() == 64 << 20, dk.cpu_cache_bytes()
with open("/proc/self/status") as status:
    vm_kib = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
# Room for one fresh 48 MiB result's inputs and block only once the kept 64 MiB is gone.
limit = (vm_kib << 10) + (90 << 20)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
result(6144)  # 48 MiB: refused until the kept 64 MiB block is unmapped
print("kept after", dk.cpu_cache_bytes())
"""


@pytest.mark.skipif(bool(os.environ.get("LD_PRELOAD")), reason="an address-space limit and ASan's shadow do not mix")
def test_a_request_the_system_refuses_first_releases_what_is_kept():
    run = subprocess.run([sys.executable, "-c", REFUSED_REQUEST], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    # Only the 48 MiB block, freed last, is kept: the 64 MiB one went back to the system
    # (the default limit would have kept both).
    assert f"kept after {48 * MIB}" in run.stdout
