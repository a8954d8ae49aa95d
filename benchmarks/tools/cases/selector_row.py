"""Case: one bench_selector.py CPU row (ours, compiled, floor); args: API LEVEL RANK BACKWARD."""

import os
import sys

import torch

NAMES = ["ours", "compiled", "floor"]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def make(api="pair_scores", level="op", rank="256", backward="0"):
    import bench_selector as bs

    shape = bs.Shape(4096, 32000, 1024, torch.float32, rank=int(rank))
    inputs = bs.Inputs(shape, torch.device("cpu"))
    params = [inputs.selector.hidden_projection.weight, *inputs.codebooks]
    first = inputs.hidden if level == "module" else inputs.projected
    unary = inputs.logits if api == "score_candidates" else inputs.unary
    leaves = [first.detach().requires_grad_(), unary.detach().requires_grad_()]
    grad_leaves = (leaves + (params if level == "module" else params[1:])) if backward == "1" else None
    ours, ref = bs.implementations(api, level, inputs)
    return {
        "ours": bs._call(ours, leaves, grad_leaves, inputs.grad),
        "compiled": bs._call(torch.compile(ref, dynamic=False), leaves, grad_leaves, inputs.grad),
        "floor": bs.floor(api, level, backward == "1", inputs, shape),
    }
