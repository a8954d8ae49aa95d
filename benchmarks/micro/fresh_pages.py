"""500 MB written into fresh or kept pages: fresh_pages.py alone|turns|nohuge|kept."""

# alone: a fresh 2 MB-page mapping written each call; turns: the same after two 500 MB
# torch.zeros written and freed (as the other implementations do in the benchmarks);
# nohuge: as turns, 4 KB pages; kept: one mapping made once and written again each call
# (what the C++ ops' CPU result cache gives). Per call: ms and the /proc/vmstat counters
# that moved. On the 2-core dev VM (aaa5a59, 2026-12-02): fresh 2 MB pages ~60 ms,
# 58-1183 ms in turns, fresh 4 KB pages 236-364 ms, kept memory 17-20 ms.

import argparse
import mmap
import time

import numpy as np
import torch

SIZE = 4096 * 32000 * 4
KEYS = ("thp_fault_alloc", "pgfault", "compact_stall", "pgscan_direct", "thp_fault_fallback", "pgmajfault")


def vmstat() -> dict:
    with open("/proc/vmstat") as f:
        return {k: int(v) for k, v in (line.split() for line in f)}


def others_allocate() -> None:
    for _ in range(2):
        t = torch.zeros(SIZE // 4)
        t += 1
        del t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("mode", choices=("alone", "turns", "nohuge", "kept"))
    parser.add_argument("--calls", type=int, default=24)
    args = parser.parse_args()
    kept = None
    if args.mode == "kept":
        kept = mmap.mmap(-1, SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        kept.madvise(mmap.MADV_HUGEPAGE)
    times = []
    for _ in range(args.calls):
        if args.mode != "alone":
            others_allocate()
        before, start = vmstat(), time.perf_counter()
        m = kept or mmap.mmap(-1, SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if kept is None and args.mode != "nohuge":
            m.madvise(mmap.MADV_HUGEPAGE)
        a = np.frombuffer(m, dtype=np.float32)
        a[:] = 0.0
        del a
        if kept is None:
            m.close()
        times.append((time.perf_counter() - start) * 1e3)
        after = vmstat()
        print(f"{times[-1]:8.1f} ms", {k: after[k] - before[k] for k in KEYS if after.get(k, 0) != before.get(k, 0)})
    times.sort()
    print(f"{args.mode}: min {times[0]:.1f} median {times[len(times) // 2]:.1f} max {times[-1]:.1f} ms")


if __name__ == "__main__":
    main()
