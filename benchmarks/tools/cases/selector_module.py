"""Case: CandidateSelector.pair_scores fwd+bwd from h at bench_selector's CPU shape; args: RANK."""

import torch

NAMES = ["module fwd+bwd"]


def make(rank="64"):
    import dflash2_kernels as dk

    torch.manual_seed(0)
    n, v, h, r, k = 4096, 32000, 1024, int(rank), 16
    selector = dk.CandidateSelector(v, h, r, k)
    with torch.no_grad():  # upstream starts it at zero; trained codebooks are not
        selector.successor_codebook.normal_(0.0, 0.02)
    hidden, unary, grad = torch.randn(n, h), torch.randn(n, k), torch.randn(n, k)
    pred, cand = torch.randint(0, v, (n,)), torch.randint(0, v, (n, k))
    params = [selector.hidden_projection.weight, selector.predecessor_codebook, selector.successor_codebook]

    def module():
        leaves = [hidden.detach().requires_grad_(), unary.detach().requires_grad_()]
        return torch.autograd.grad(selector.pair_scores(leaves[0], leaves[1], cand, pred), leaves + params, grad)

    return {"module fwd+bwd": module}
