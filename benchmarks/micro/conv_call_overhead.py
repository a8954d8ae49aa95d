"""The conv's per-call overhead at 64 x 256 fp32, three routes: python conv_call_overhead.py."""

# The kernel itself is the raw op's time; the rest is Python and dispatch. Before the
# eager CPU route (ops._EagerCpuConv, a6ac912) the public function took 75 us here and
# the custom op 56 us; after, 25 and 29 us, the raw op 7 us (2-thread VM, 2026-12-01).

import statistics
import time

import torch

import dflash2_kernels as dk


def median_us(fn, reps: int = 2000) -> float:
    for _ in range(50):
        fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def main() -> None:
    x = torch.randn(64, 256)
    delta = torch.randn(64, 2, 2, 16)[:, 1]  # one side of the projection's [N, 2, K, G] output
    base = torch.randn(2, 256)
    calls = {
        "public function": lambda: dk.grouped_dynamic_conv(x, delta, base, block_size=8, group_size=16),
        "custom op": lambda: torch.ops.dflash2.grouped_dynamic_conv(x, delta, base, 8, 16),
        "raw C++ op": lambda: torch.ops.dflash2.conv_forward_cpu(x, delta.reshape(64, 2, 16), base, 8, torch.float32),
    }
    with torch.no_grad():
        for name, fn in calls.items():
            print(f"{name:16s} {median_us(fn):8.1f} us a call")


if __name__ == "__main__":
    main()
