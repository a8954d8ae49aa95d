"""The draft head's forward+backward time against its tile budget (DFLASH2_HEAD_TILE_MB), to choose the default."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dflash2_kernels as dk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--budgets", type=float, nargs="+", default=[4, 16, 32, 64, 128, 256])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    hidden = torch.randn(args.rows, args.width, requires_grad=True)
    target = torch.randn(args.rows, args.width)
    weight = torch.randn(args.vocab, args.width) / args.width ** 0.5
    times = {budget: [] for budget in args.budgets}
    for _ in range(args.rounds):  # budgets in turns, so a change of load lands on all of them
        for budget in args.budgets:
            start = time.perf_counter()
            out = dk.draft_head(hidden, weight, target_hidden=target, losses=("kl_div", "tv"), top_k=16, tile_mb=budget)
            (out.losses["kl_div"].sum() + out.losses["tv"].sum() + out.topk_logits.sum()).backward()
            times[budget].append(time.perf_counter() - start)
            hidden.grad = None
    print(f"fwd+bwd kl_div+tv top-16, {args.rows} x {args.vocab} x {args.width} float32, "
          f"{torch.get_num_threads()} threads, median of {args.rounds}")
    for budget, values in times.items():
        print(f"  tile {budget:7.1f} MiB: {statistics.median(values) * 1e3:8.1f} ms  (min {min(values) * 1e3:.1f})")


if __name__ == "__main__":
    main()
