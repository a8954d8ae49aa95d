"""pair.py's worker, timing one call per name read from stdin: pair_worker.py CASE.py [ARGS]."""

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _case import load  # noqa: E402


def main() -> None:
    case = load(sys.argv[1])
    fns = case.make(*sys.argv[2:])
    between = getattr(case, "between", {})
    junk = torch.empty(16 << 20) if os.environ.get("FLUSH") else None  # 64 MB, written before each call
    import dflash2_kernels

    extension = sys.modules.get("dflash2_kernels._C")
    print(f"# worker {os.getpid()}: {dflash2_kernels.__file__}, extension "  # which build this side runs
          f"{getattr(extension, '__file__', 'not loaded')}", file=sys.stderr)
    for fn in fns.values():
        for _ in range(5):
            fn()
    for line in sys.stdin:
        name = line.strip()
        if junk is not None:
            junk.fill_(1.0)
        if name in between:
            between[name]()
        start = time.perf_counter()
        fns[name]()
        sys.stdout.write(f"{(time.perf_counter() - start) * 1e3}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
