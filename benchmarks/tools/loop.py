"""One case name in a loop, min/median/p90 ms: loop.py CASE.py NAME [ARGS] [--seconds S]."""

# --between runs another of the case's names untimed before each call (e.g. the floor
# of selector_row.py, so that the call finds the cache as the bench leaves it).
# perf: perf record -g -o perf.data python benchmarks/tools/loop.py ... --seconds 20

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _case import load  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("case", help="CASE.py")
    parser.add_argument("name")
    parser.add_argument("args", nargs="*", help="the case's arguments")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--between", help="a case name run untimed before each call")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    fns = load(args.case).make(*args.args)
    fn, between = fns[args.name], fns[args.between] if args.between else None
    for _ in range(3):
        fn()
    times = []
    end = time.perf_counter() + args.seconds
    while time.perf_counter() < end:
        if between is not None:
            between()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    print(f"{args.name}: {len(times)} calls, min {times[0]:.3f} median {times[len(times) // 2]:.3f} "
          f"p90 {times[int(0.9 * len(times))]:.3f} ms")


if __name__ == "__main__":
    main()
