"""Env settings A/B in one process, paired by round: turns.py ROUNDS CASE.py [ARGS] --env E --env E."""

# The names in --vary (default: ours) run once per --env setting, with those variables
# set around the call (for kernels that read them on every call: DFLASH2_SELECTOR_ORDER,
# DFLASH2_CPU_CACHE_MB, or a temporary build's switches); the case's other names run
# once a round as they are. One process, so no build switch (pair.py does that): what it
# removes is the second process's noise. With the selector_row case its output gives
# each variant as a percent of the row's floor.

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _case import load  # noqa: E402


def with_env(fn, settings: str):
    values = dict(kv.split("=", 1) for kv in settings.split())

    def call():
        saved = {k: os.environ.get(k) for k in values}
        os.environ.update(values)
        try:
            return fn()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k)
                else:
                    os.environ[k] = v
    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("rounds", type=int)
    parser.add_argument("case", nargs="+", help="CASE.py and its arguments")
    parser.add_argument("--env", action="append", default=[], help="a setting of the varied names ('' = as is)")
    parser.add_argument("--vary", action="append", help="case names run under every --env (default: ours)")
    args = parser.parse_args()
    fns = load(args.case[0]).make(*args.case[1:])
    vary = args.vary or ["ours"]
    settings = args.env or [""]
    calls = {}
    for name, fn in fns.items():
        if name in vary:
            for setting in settings:
                calls[f"{name} [{setting}]"] = with_env(fn, setting)
        else:
            calls[name] = fn
    for fn in calls.values():
        for _ in range(3):
            fn()
    times = {name: [] for name in calls}
    order = list(calls)
    random.seed(0)
    for _ in range(args.rounds):
        random.shuffle(order)
        for name in order:
            start = time.perf_counter()
            calls[name]()
            times[name].append((time.perf_counter() - start) * 1e3)
    floor = statistics.median(times["floor"]) if "floor" in times else None
    for name, values in times.items():
        line = f"{name:40s} median {statistics.median(values):8.3f} ms"
        if floor:
            line += f"  {100 * statistics.median(values) / floor:5.0f}% of the floor"
        first = next((n for n in calls if n.startswith(name.split(" [")[0] + " [")), None)  # its first setting
        if " [" in name and first != name:
            ratio = statistics.median(a / b for a, b in zip(values, times[first]))
            line += f"  paired/{first.split(' [', 1)[1][:-1] or 'as is'} {ratio:.3f}"
        print(line)


if __name__ == "__main__":
    main()
