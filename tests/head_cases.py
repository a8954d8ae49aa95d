"""Inputs and the float64 judge of the draft head's tests (SPEC sections 4 and 7)."""

from __future__ import annotations

import torch

from dflash2_kernels import reference

GRAD_OUTPUTS = ("losses", "topk_logits", "label_logit")


def gpu_driver_runs() -> bool:
    """Whether the head's GPU driver (its Triton kernels) can run here: on CUDA, or on CPU
    tensors under Triton's interpreter."""
    from dflash2_kernels._backend import triton_importable

    if not triton_importable():
        return False
    from dflash2_kernels.head.gpu_launch import KERNELS_INTERPRETED

    return KERNELS_INTERPRETED or torch.cuda.is_available()


def make_inputs(rows, vocab, width, *, hidden_dtype=torch.float32, weight_dtype=None, target=True, labels="given",
                lead=None, seed=0, scale=1.0):
    """hidden [*lead or rows, H], weight [V, H], target_hidden like hidden, labels (None,
    'given' with every fourth row ignored, or 'none'). Weights scaled so logits spread over
    a few units, as a trained head's do."""
    weight_dtype = weight_dtype or hidden_dtype
    gen = torch.Generator().manual_seed(seed)
    shape = tuple(lead) if lead is not None else (rows,)
    hidden = torch.randn(*shape, width, generator=gen, dtype=torch.float64).to(hidden_dtype)
    weight = (torch.randn(vocab, width, generator=gen, dtype=torch.float64) * scale * 2 / width ** 0.5)
    weight = weight.to(weight_dtype)
    target_hidden = None
    if target:
        target_hidden = (hidden.double() + 0.7 * torch.randn(*shape, width, generator=gen, dtype=torch.float64))
        target_hidden = target_hidden.to(hidden_dtype)
    label_ids = None
    if labels == "given":
        label_ids = torch.randint(0, vocab, shape, generator=gen)
        label_ids.view(-1)[::4] = reference.IGNORE_INDEX
    return hidden, weight, target_hidden, label_ids


def nan_and_inf_inputs():
    """make_inputs(6, 64, 8) with label 5 everywhere and non-finite rows: a NaN in hidden
    row 1, +inf in target row 2, hidden row 3 all zero but one +inf."""
    hidden, weight, target, labels = make_inputs(6, 64, 8, labels="given")
    labels[:] = 5
    hidden[1, 2] = float("nan")
    target[2, 0] = float("inf")
    hidden[3] = 0.0
    hidden[3, 0] = float("inf")
    return hidden, weight, target, labels


def exact(hidden, weight, target_hidden, labels, losses, logit_scale=1.0, softcap=None):
    """The dense formulas in float64 of the operands as the head takes them (hidden in
    weight's dtype): losses (float64, 0 on ignored rows), z [N, V] and t [N, V] float64,
    differentiable w.r.t. the returned float64 leaves (hidden, weight)."""
    h64 = hidden.detach().to(weight.dtype).double().requires_grad_(hidden.requires_grad)
    w64 = weight.detach().double().requires_grad_(weight.requires_grad)
    width = hidden.shape[-1]
    z = reference.draft_head_logits(h64, w64, logit_scale, softcap).reshape(-1, weight.shape[0])
    t = None
    if target_hidden is not None:
        th = target_hidden.detach().to(weight.dtype).double()
        t = reference.draft_head_logits(th.reshape(-1, width), w64.detach(), logit_scale, softcap)
    label = labels.reshape(-1) if labels is not None else (t.argmax(-1) if t is not None else None)
    ignored = None if label is None else label == reference.IGNORE_INDEX
    safe = None if label is None else torch.where(ignored, 0, label)
    rows = reference.draft_head_row_losses(z, t, safe, tuple(losses))
    out = {}
    for name in losses:
        value = rows[name]
        out[name] = torch.where(ignored, torch.zeros_like(value), value) if ignored is not None else value
    return dict(losses=out, z=z, t=t, label=label, safe=safe, hidden=h64, weight=w64)


def upstream_weights(out, top_k, seed=1):
    """Fixed random upstream gradients for the differentiable outputs of a DraftHeadOutput."""
    gen = torch.Generator().manual_seed(seed)
    rows = out.draft_lse.numel()
    loss_weights = {name: torch.rand(rows, generator=gen, dtype=torch.float64) for name in sorted(out.losses)}
    return loss_weights, torch.randn(rows, top_k, generator=gen, dtype=torch.float64), \
        torch.randn(rows, generator=gen, dtype=torch.float64)


def objective(losses, topk_logits, label_logit, weights):
    """sum_l w_l . loss_l + g_topk . topk_logits + g_label . label_logit (in float64)."""
    loss_weights, grad_topk, grad_label = weights
    total = sum((loss_weights[name] * losses[name].reshape(-1).double()).sum() for name in sorted(losses))
    total = total + (grad_topk * topk_logits.reshape(grad_topk.shape).double()).sum()
    if label_logit is not None:
        total = total + (grad_label * label_logit.reshape(-1).double()).sum()
    return total
