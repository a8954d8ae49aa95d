"""Case: the raw selector ops at bench_selector's CPU shape, gathered and full unary; args: RANK."""

import torch

NAMES = ["fwd", "bwd", "fwd full", "bwd full"]


def make(rank="64"):
    import dflash2_kernels  # noqa: F401  (registers torch.ops.dflash2)

    torch.manual_seed(0)
    n, v, r, k = 4096, 32000, int(rank), 16
    a, b = torch.randn(v, r) * 0.02, torch.randn(v, r) * 0.02
    p, grad = torch.randn(n, r), torch.randn(n, k)
    logits = torch.randn(n, v)
    pred, cand = torch.randint(0, v, (n,)), logits.topk(k, -1).indices
    unary = logits.gather(-1, cand)
    ops = torch.ops.dflash2
    return {
        "fwd": lambda: ops.selector_scores(unary, p, a, b, pred, cand, True, torch.float32),
        "bwd": lambda: ops.selector_scores_backward(grad, p, a, b, pred, cand, True, k, torch.float32),
        "fwd full": lambda: ops.selector_scores(logits, p, a, b, pred, cand, False, torch.float32),
        "bwd full": lambda: ops.selector_scores_backward(grad, p, a, b, pred, cand, False, v, torch.float32),
    }
