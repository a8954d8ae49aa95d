"""Minor page faults and ms of each call: faults.py CASE.py [ARGS] [--names A,B]."""

# A call that writes fresh pages pays one fault per 4 KB page (or per 2 MB huge page):
# this shows whether a result or temporary came from memory kept from an earlier call
# (0 faults; dflash2_kernels.memory, DFLASH2_CPU_CACHE_MB) or from glibc's fresh maps.
# --warmup 0 shows the first calls of a fresh process too.

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _case import load  # noqa: E402


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("case", nargs="+", help="CASE.py and its arguments")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--names", help="only these of the case's names (comma-separated)")
    args = parser.parse_args()
    for name, fn in load(args.case[0]).make(*args.case[1:]).items():
        if args.names and name not in args.names.split(","):
            continue
        for _ in range(args.warmup):
            fn()
        faults, times = [], []
        for _ in range(args.calls):
            before, start = minor_faults(), time.perf_counter()
            fn()
            times.append(f"{(time.perf_counter() - start) * 1e3:.2f}")
            faults.append(minor_faults() - before)
        print(f"{name:16s} minor faults per call {faults}  ms {times}")


if __name__ == "__main__":
    main()
