"""Two builds or settings as two processes, paired ratios: pair.py ROUNDS ENV_A ENV_B CASE.py [ARGS]."""

# ENV_A / ENV_B: space-separated NAME=VALUE settings for each worker process ('' = as
# is), e.g. 'DFLASH2_EXTENSION_PATH=/tmp/old/_C.so' (another build of the extension),
# 'PYTHONPATH=/tmp/oldpkg' (another copy of the package) or 'DFLASH2_SELECTOR_ORDER=row'.
# Each round calls every case name once in each worker, the order of the two alternating
# by round; the result is the median over rounds of B's time over A's in the same round.
# On a VM whose speed moves 2x between minutes, only such paired ratios are comparable;
# the forward of an unchanged op gave 0.955-1.033 this way: the method's noise floor.
# FLUSH=1 makes each worker write 64 MB before every call (the case's data then starts
# outside the cache, as in a training step).

import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _case import load  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def start(settings: str, case: list[str]) -> subprocess.Popen:
    extra = dict(kv.split("=", 1) for kv in settings.split())
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra.get("PYTHONPATH"), str(REPO)) if p)
    worker = Path(__file__).resolve().parent / "pair_worker.py"
    return subprocess.Popen([sys.executable, str(worker), *case], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env, cwd=REPO)


def main() -> None:
    if len(sys.argv) < 5:
        sys.exit(__doc__)
    rounds, settings, case = int(sys.argv[1]), sys.argv[2:4], sys.argv[4:]
    names = load(case[0]).NAMES
    workers = {"a": start(settings[0], case), "b": start(settings[1], case)}
    times = {(w, n): [] for w in workers for n in names}
    for i in range(rounds):
        for name in names:
            for w in ("a", "b") if i % 2 == 0 else ("b", "a"):
                workers[w].stdin.write(name + "\n")
                workers[w].stdin.flush()
                times[(w, name)].append(float(workers[w].stdout.readline()))
    for worker in workers.values():
        worker.stdin.close()
        worker.wait()
    print(f"# A: {settings[0] or '(as is)'}  B: {settings[1] or '(as is)'}  {rounds} rounds, ms")
    for name in names:
        a, b = times[("a", name)], times[("b", name)]
        ratio = statistics.median(y / x for x, y in zip(a, b))
        print(f"{name:16s} A min {min(a):8.3f} med {statistics.median(a):8.3f} | B min {min(b):8.3f} "
              f"med {statistics.median(b):8.3f} | paired B/A {ratio:.3f}")


if __name__ == "__main__":
    main()
