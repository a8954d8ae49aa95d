"""Python time per call of the ops' GPU paths with the device work stubbed, on the CPU.

    python benchmarks/micro/call_overhead.py [--reps 3000]

What an eager CUDA call costs the host besides its kernels' launches (issue 39: at most
20 us for the conv and the selector), measured where no GPU is: each op's real Python
path at a serving size (256 rows) on CPU tensors, with what would reach the device
replaced by a stub:

- conv (the Triton route: DFLASH2_BACKEND=triton under TRITON_INTERPRET=1, so CPU tensors
  take the launchers' code): every ``KernelLaunch.run`` a no-op, so the time is the
  public function's checks, the eager autograd.Function, the launch plans and the result
  allocations; forward under no_grad, and forward + backward through autograd;
- selector (``score_candidates``, ``pair_scores``): the C++ ops at one row, one candidate
  and rank 1, where the kernel itself is well under a microsecond: the time is the Python
  layer, the dispatcher and the autograd registration;
- the conv's CPU route at 64 x 256 fp32 under no_grad, three ways: the public function,
  the custom op, the raw C++ op (whose time is the kernel's; the rest is Python and
  dispatch). Before the eager route (a6ac912) the public function took 75 us there and
  the custom op 56 us; after, 25 and 29 us, the raw op 7 us (2-thread VM, 2026-12-01).

Each forward + backward row is followed by torch's share of it: the same call shape through
an autograd.Function that does nothing (a view forward, cached gradients backward), which
is what the autograd engine, ``torch.autograd.grad`` and the loss's ``sum`` cost whoever
computes the op; ours is the difference. A CUDA call adds its launches (Triton's Python
launcher: 6-27 us a launch, published) and the CUDA caching allocator's bookkeeping, where
a large CPU allocation here costs more than it does there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: CPU tensors take the Triton route

import torch  # noqa: E402

import dflash2_kernels as dk  # noqa: E402
from dflash2_kernels.conv import launch  # noqa: E402


def median_us(fn, reps: int) -> float:
    for _ in range(min(200, reps)):
        fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


class _Nothing(torch.autograd.Function):
    """A view of the first input forward, the given cached gradients backward: the autograd
    engine's own cost for a call of that many differentiable inputs."""

    @staticmethod
    def forward(ctx, grads, first, *rest):
        ctx.grads = grads
        return first.view_as(first)

    @staticmethod
    def backward(ctx, grad):
        return (None, *ctx.grads)


def conv_calls() -> dict:
    rows, hidden, groups = 256, 5120, 5120 // 16
    x = torch.randn(rows, hidden, dtype=torch.bfloat16)
    delta = torch.randn(rows, 2, 2, groups, dtype=torch.bfloat16)[:, 1]
    base = torch.randn(2, hidden)  # speculators' fp32 base
    leaves = [t.detach().requires_grad_() for t in (x, delta, base)]
    dy = torch.randn(rows, hidden, dtype=torch.bfloat16)

    def forward():
        with torch.no_grad():
            dk.grouped_dynamic_conv(x, delta, base, block_size=8, group_size=16)

    def forward_backward():
        out = dk.grouped_dynamic_conv(*leaves, block_size=8, group_size=16)
        torch.autograd.grad(out, leaves, dy)

    cached = [torch.zeros_like(t) for t in leaves]

    def torch_share():
        torch.autograd.grad(_Nothing.apply(cached, *leaves), leaves, dy)

    return {"conv fwd 256x5120 bf16 (no_grad)": forward, "conv fwd+bwd 256x5120 bf16": forward_backward,
            "  torch's share (engine, grad)": torch_share}


def selector_calls() -> dict:
    vocab, rank = 8, 1
    codebooks = [torch.randn(vocab, rank, requires_grad=True) for _ in range(2)]
    projected = torch.randn(1, rank, requires_grad=True)
    logits = torch.randn(1, vocab, requires_grad=True)
    unary = torch.randn(1, 1, requires_grad=True)
    pred, cand = torch.tensor([3]), torch.tensor([[5]])

    def scores(backward: bool, pair: bool):
        def call():
            if pair:
                out = dk.pair_scores(projected, unary, *codebooks, cand, pred)
            else:
                out = dk.score_candidates(logits, projected, *codebooks, pred, cand)
            if backward:
                out.sum().backward()
        return call

    def torch_share(first):
        leaves = [first, projected, *codebooks]
        cached = [torch.zeros_like(t) for t in leaves]
        return lambda: _Nothing.apply(cached, *leaves).sum().backward()

    return {
        "selector score_candidates fwd": scores(False, False),
        "selector score_candidates fwd+bwd": scores(True, False),
        "  torch's share (engine, sum, backward)": torch_share(logits),
        "selector pair_scores fwd": scores(False, True),
        "selector pair_scores fwd+bwd": scores(True, True),
        "  torch's share (engine, sum, backward) ": torch_share(unary),
    }


def conv_cpu_calls() -> dict:
    x = torch.randn(64, 256)
    delta = torch.randn(64, 2, 2, 16)[:, 1]  # one side of the projection's [N, 2, K, G] output
    base = torch.randn(2, 256)
    flat_delta = delta.reshape(64, 2, 16)

    def no_grad(fn):
        def call():
            with torch.no_grad():
                fn()
        return call

    return {
        "conv CPU 64x256 fp32: public function": no_grad(
            lambda: dk.grouped_dynamic_conv(x, delta, base, block_size=8, group_size=16)),
        "conv CPU 64x256 fp32: custom op": no_grad(lambda: torch.ops.dflash2.grouped_dynamic_conv(x, delta, base, 8, 16)),
        "conv CPU 64x256 fp32: raw C++ op": no_grad(
            lambda: torch.ops.dflash2.conv_forward_cpu(x, flat_delta, base, 8, torch.float32)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3000)
    args = parser.parse_args()
    os.environ["DFLASH2_BACKEND"] = "triton"
    launched = []
    launch.KernelLaunch.run = lambda self, device_of: launched.append(self.kernel)
    for name, fn in conv_calls().items():
        launched.clear()
        fn()
        stubbed = f"  ({len(launched)} launches stubbed)" if launched else ""
        print(f"{name:40s} {median_us(fn, args.reps):7.1f} us a call{stubbed}")
    os.environ["DFLASH2_BACKEND"] = "auto"
    for name, fn in {**selector_calls(), **conv_cpu_calls()}.items():
        print(f"{name:40s} {median_us(fn, args.reps):7.1f} us a call")


if __name__ == "__main__":
    main()
