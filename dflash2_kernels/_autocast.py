"""What the ``dflash2::`` ops do inside ``torch.autocast`` (registered at import).

The judge is upstream's PyTorch under the same autocast: ``dflash2_kernels.reference``
run inside ``torch.autocast``. Autocast never casts a custom op's inputs by itself (its
default for an op it does not know is a fallthrough), and the upstream code each op
replaces is mostly elementwise, gathers and reductions, which autocast leaves alone:

- the conv (``grouped_dynamic_conv`` and its backward, ``conv_*_cpu``): speculators'
  arithmetic is elementwise, so under autocast it still returns
  ``promote_types(x, delta)`` (fp32 for autocast's fp32 hidden with a bf16 strided delta)
  from the operands as given. Our kernels take those mixed dtypes natively and compute in
  fp32, so the op falls through: ``torch.library.register_autocast`` would cast every
  floating input to one dtype (a bf16 copy of the fp32 hidden, and a bf16 result where
  upstream's is fp32), the opposite of what upstream does;
- ``selector_scores`` in speculators' form (``score_candidates``, ``transition_scores``):
  gathers, products and sums, no autocast op: the caller's ``out_dtype`` stands (the
  kernels read a bf16 projection next to fp32 codebooks as it is);
- ``candidate_topk``, ``rejection_sample``, the backward of the selector: no autocast op
  upstream; their dtypes do not depend on autocast.

Where upstream does change under autocast, a custom autocast kernel below gives the
op upstream's output dtype, copying no operand (the kernels still compute in fp32 and
round once), and runs the op with autocast excluded, as ``register_autocast`` does:

- ``selector_scores`` in NeMo's pair form (``pair_scores``: unary already gathered, scores
  in ``promote(unary, codebooks, projected)``): NeMo's transition is an ``einsum`` -> ``bmm``,
  which autocast runs in its dtype, so the scores come out in ``promote(unary, autocast
  dtype)``;
- ``select_path`` (``edge_scores`` / ``walk``): NeMo's edge scores are the same einsum added
  to the logits: edges in ``promote(logits, autocast dtype)``, and the walk takes its
  argmax / softmax over edges rounded to that dtype, as upstream's walk does;
- ``draft_head`` and its backward: same dtypes as without autocast (the head casts hidden
  to the lm_head's dtype and accumulates in fp32, its results' dtypes are fixed), but
  their Python implementation calls ``einsum`` / ``bmm``: excluded from autocast, a
  backward run inside ``torch.autocast`` gives the gradients it gives outside.

Known limit (no caller passes it): ``transition_scores`` with fp16 codebooks under bf16
autocast (or bf16 codebooks under fp16 autocast) and a projection no wider than them is
indistinguishable, at the op, from the pair form and gets ``promote(codebook, autocast
dtype)`` (fp32) where speculators keeps the codebook dtype.
"""

from __future__ import annotations

import torch

__all__ = ["FALLTHROUGH", "RULES", "autocast_dtype", "serving_score_dtype"]

# op name -> rule(device_type, args) -> args (the op's arguments, out dtype adjusted).
RULES: dict = {}
# The ops autocast falls through (no kernel registered), and why (the docstring above).
FALLTHROUGH = {
    "grouped_dynamic_conv": "elementwise upstream: promote(x, delta) from the operands as given",
    "grouped_dynamic_conv_backward": "gradients in the inputs' dtypes",
    "conv_forward_cpu": "the conv's C++ kernel: mixed dtypes natively, out_dtype explicit",
    "conv_backward_cpu": "the conv's C++ kernel: gradients in the inputs' dtypes",
    "selector_scores_backward": "gradients in the inputs' dtypes (C++, no autocast op inside)",
    "candidate_topk": "torch.topk upstream: logits' dtype",
    "rejection_sample": "no autocast op upstream; int64 results",
    "draft_head_rows_cpu": "internal C++ row kernel, called with autocast already excluded",
    "draft_head_rows_backward_cpu": "internal C++ row kernel, called with autocast already excluded",
    "draft_head_shard_stats_cpu": "internal C++ vocab-parallel row kernel, called with autocast already excluded",
    "draft_head_shard_rows_cpu": "internal C++ vocab-parallel row kernel, called with autocast already excluded",
    "cpu_cached_empty": "an allocation: no floating-point input to cast, the dtype is an argument",
}

_LIB = None  # the torch.library.Library holding the kernels (kept alive with the module)
_DEVICE_TYPES = ("cpu", "cuda")
_WIDE = (torch.float64,)


def autocast_dtype(device_type: str) -> torch.dtype:
    return torch.get_autocast_dtype(device_type)


def _einsum_dtype(device_type: str, *operands: torch.dtype) -> torch.dtype | None:
    """The dtype autocast gives an einsum over operands of these dtypes on device_type:
    the autocast dtype when autocast is on there and no operand is float64 (which it
    never casts), else None (no change)."""
    if any(dtype in _WIDE for dtype in operands):
        return None
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know
        return None
    return autocast_dtype(device_type) if enabled else None


def serving_score_dtype(logits: torch.Tensor, projected: torch.Tensor, codebook: torch.Tensor) -> torch.dtype:
    """The edge scores' dtype as NeMo's code gives it where this is called:
    ``reference.serving_score_dtype`` outside autocast, ``promote(logits, autocast dtype)``
    inside (its transition is an autocast einsum). For the serving functions' reference path."""
    from .reference import serving_score_dtype as plain

    dtype = plain(logits, projected, codebook)
    inside = _einsum_dtype(logits.device.type, torch.promote_types(codebook.dtype, projected.dtype))
    return dtype if inside is None else torch.promote_types(logits.dtype, inside)


def _pair_scores_rule(device_type: str, args: tuple) -> tuple:
    unary, projected, predecessor_codebook, successor_codebook, pred, cand, gathered, out_dtype = args
    operands = torch.promote_types(predecessor_codebook.dtype, projected.dtype)
    if (gathered and operands not in _WIDE and successor_codebook.dtype not in _WIDE
            and out_dtype == torch.promote_types(unary.dtype, operands)):
        out_dtype = torch.promote_types(unary.dtype, autocast_dtype(device_type))
        return unary, projected, predecessor_codebook, successor_codebook, pred, cand, gathered, out_dtype
    return args


def _select_path_rule(device_type: str, args: tuple) -> tuple:
    logits, projected, predecessor_codebook, successor_codebook, anchors, draws, top_k, temperature, score_dtype = args
    operands = torch.promote_types(predecessor_codebook.dtype, projected.dtype)
    if operands not in _WIDE and score_dtype == torch.promote_types(logits.dtype, operands):
        score_dtype = torch.promote_types(logits.dtype, autocast_dtype(device_type))
        return (logits, projected, predecessor_codebook, successor_codebook, anchors, draws, top_k, temperature,
                score_dtype)
    return args


def _unchanged(device_type: str, args: tuple) -> tuple:
    return args


def _register(op_name: str, rule) -> None:
    """An autocast kernel per device type: ``rule`` on the arguments, then the op with that
    device's autocast key excluded (torch.library.register_autocast's mechanism, with a
    rule in place of one input dtype), also as a Python-dispatcher kernel for tracing."""
    global _LIB
    if _LIB is None:
        _LIB = torch.library.Library("dflash2", "IMPL")
    op = getattr(torch.ops.dflash2, op_name).default
    for device_type in _DEVICE_TYPES:
        if not torch._C._is_autocast_available(device_type):
            continue
        key_name = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        key = getattr(torch._C.DispatchKey, key_name)

        def run(*args, _device_type=device_type, _key=key):
            with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_key)):
                return op(*rule(_device_type, args))

        def kernel(_keyset, *args, _run=run):
            return _run(*args)

        if op.has_kernel_for_dispatch_key(key):
            op.py_kernels.pop(key, None)
        op.py_impl(key)(run)
        _LIB.impl(op_name, kernel, key_name, with_keyset=True)
    RULES[op_name] = rule


def _register_all() -> None:
    ops = set(torch._C._dispatch_get_all_op_names())
    for op_name, rule in (("selector_scores", _pair_scores_rule), ("select_path", _select_path_rule),
                          ("draft_head", _unchanged), ("draft_head_backward", _unchanged)):
        if f"dflash2::{op_name}" in ops:
            _register(op_name, rule)


_register_all()
