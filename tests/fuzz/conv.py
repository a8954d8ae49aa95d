"""Fuzz cases for the grouped dynamic conv (SPEC section 1): the public function, NeMo's
signature, the module, and the raw ops (``dflash2::grouped_dynamic_conv`` and its
backward, ``conv_forward_cpu``, ``conv_backward_cpu``).

Valid results are judged against ``dk.reference`` run in the input dtype and in
float64 (SPEC section 4), gradients included. Taps at or beyond the block size never
reach inside a block, so where an op takes K > L (NeMo's decode call, the raw ops) the
reference is evaluated on the first L taps and the others get zero gradients.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass

import torch

import dflash2_kernels as dk
from dflash2_kernels import reference

from ..conv_cases import conv_with_grads, exact_conv_with_grads
from ..host_blas import pinned_outputs, values_of
from ..triton_interpreter import FAULT as INTERPRETER_FAULT
from .case import Agrees, Call, Case, threads
from .draw import FLOATS, Draw
from .judges import assert_contract, assert_equal, compute_dtype
from .mutations import (
    Mutation,
    at_op_boundary,
    bad_case,
    dtype_argument_mutations,
    float_tensor_mutations,
    size_mutations,
    with_dim_dropped,
    with_dim_resized,
    with_extra_dim,
)

BAD_FRACTION = 0.5
# Sizes a block_size may take that no row count reaches: one block holds every row.
HUGE_BLOCKS = (2**31, 2**40, 2**62, 2**63 - 1)
# Work per case (rows x channels): keeps a few hundred cases within seconds.
MAX_ELEMENTS = 12_000
# The Triton interpreter runs ~100x slower: only tiny cases go through it.
MAX_TRITON_ELEMENTS = 1_500


@dataclass(frozen=True)
class ConvShape:
    """Sizes and dtypes of one conv call; ``block_size``/``group_size`` as conv_cases expects."""

    lead: tuple[int, ...]
    hidden: int
    group_size: int
    kernel_size: int
    block_size: int
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype]  # x, delta, base

    @property
    def groups(self) -> int:
        return self.hidden // self.group_size

    @property
    def rows(self) -> int:
        rows = 1
        for size in self.lead:
            rows *= size
        return rows

    @property
    def out_dtype(self) -> torch.dtype:
        return torch.promote_types(self.dtypes[0], self.dtypes[1])


def draw_shape(draw: Draw, *, taps_above_block: float = 0.0, lead=None, block_size=None,
               allow_empty_hidden: bool = True) -> ConvShape:
    """Random sizes: odd group sizes, K from 1 to 4, L from K up (sometimes astronomically
    large), empty rows and (rarely) an empty hidden dim; mixed dtypes as under autocast."""
    group_size = draw.pick([1, 2, 3, 4, 5, 8, 12, 16, 16, 16, 24, 32, 300])
    groups = 0 if allow_empty_hidden and draw.chance(0.03) else draw.size(1, max(1, 640 // group_size))
    hidden = group_size * groups
    kernel_size = draw.pick([1, 2, 2, 2, 3, 4])
    if block_size is None:
        if draw.chance(taps_above_block):
            block_size = draw.integer(1, kernel_size - 1) if kernel_size > 1 else 1
        elif draw.chance(0.08):
            block_size = draw.pick(HUGE_BLOCKS)
        else:
            block_size = kernel_size + draw.size(0, 17)
    if lead is None:
        lead = draw.lead_dims(3, max(1, MAX_ELEMENTS // max(hidden, 1)))
    x_dtype = draw.dtype(FLOATS)
    delta_dtype = x_dtype if draw.chance(0.5) else draw.dtype(FLOATS)
    base_dtype = x_dtype if draw.chance(0.5) else draw.dtype(FLOATS)
    return ConvShape(tuple(lead), hidden, group_size, kernel_size, block_size, (x_dtype, delta_dtype, base_dtype))


def draw_tensors(draw: Draw, shape: ConvShape, *, unit_last_stride: bool = False):
    """(x [..., H], delta [..., K, G], base [K, H], dy [..., H] in the output dtype).

    delta is half the time one side of a [..., 2, K, G] projection (row stride 2*K*G),
    as speculators' module hands it over; the rest get random layouts.
    """
    x_dtype, delta_dtype, base_dtype = shape.dtypes
    x = draw.layout(draw.randn((*shape.lead, shape.hidden), x_dtype), unit_last_stride=unit_last_stride)
    if draw.chance(0.5):
        both_sides = draw.randn((*shape.lead, 2, shape.kernel_size, shape.groups), delta_dtype, 0.5)
        delta = both_sides[..., draw.integer(0, 1), :, :]
    else:
        delta = draw.layout(draw.randn((*shape.lead, shape.kernel_size, shape.groups), delta_dtype, 0.5),
                            unit_last_stride=unit_last_stride)
    base = draw.layout(draw.randn((shape.kernel_size, shape.hidden), base_dtype), unit_last_stride=unit_last_stride,
                       expand=False)
    dy = draw.layout(draw.randn((*shape.lead, shape.hidden), shape.out_dtype), unit_last_stride=unit_last_stride)
    return x, delta, base, dy


@contextlib.contextmanager
def backend(name: str):
    """DFLASH2_BACKEND for the duration of a call (read on every call)."""
    saved = os.environ.get("DFLASH2_BACKEND")
    os.environ["DFLASH2_BACKEND"] = name
    try:
        yield
    finally:
        if saved is None:
            del os.environ["DFLASH2_BACKEND"]
        else:
            os.environ["DFLASH2_BACKEND"] = saved


def effective(shape: ConvShape, x, delta, base):
    """The taps that can apply: K > L taps beyond the block never reach inside it."""
    taps = min(shape.kernel_size, shape.block_size)
    return dataclasses.replace(shape, kernel_size=taps), delta[..., :taps, :], base[:taps]


def _padded_taps(grad: torch.Tensor, kernel_size: int, dim: int) -> torch.Tensor:
    """A gradient over the first taps, padded with zeros to kernel_size taps along dim."""
    missing = kernel_size - grad.shape[dim]
    if missing == 0:
        return grad
    zeros_shape = list(grad.shape)
    zeros_shape[dim] = missing
    return torch.cat([grad, grad.new_zeros(zeros_shape)], dim=dim)


def reference_results(shape: ConvShape, x, delta, base, dy) -> tuple[dict, dict]:
    """(in the input dtype, in float64): {'out', 'dx', 'ddelta', 'dbase'} of the reference."""
    used, delta_used, base_used = effective(shape, x, delta, base)
    # A raw backward may get dy in another float dtype; autograd wants the output's.
    in_dtype = conv_with_grads(reference.grouped_dynamic_conv, x, delta_used, base_used, dy.to(shape.out_dtype), used)
    exact = exact_conv_with_grads(x, delta_used, base_used, dy, used)
    results = []
    for out, dx, ddelta, dbase in (in_dtype, exact):
        results.append({
            "out": out, "dx": dx,
            "ddelta": _padded_taps(ddelta, shape.kernel_size, -2),
            "dbase": _padded_taps(dbase, shape.kernel_size, 0),
        })
    return results[0], results[1]


def conv_judge(shape: ConvShape, x, delta, base, dy, *, names=("out", "dx", "ddelta", "dbase"),
               out_dtype=None, truncating_stores=False):
    """A judge of a result tuple in ``names`` order against the reference and float64."""

    def judge(result) -> None:
        assert isinstance(result, (tuple, list)) and len(result) == len(names), \
            f"expected {len(names)} results ({', '.join(names)}), got {type(result).__name__}"
        in_dtype, exact = reference_results(shape, x, delta, base, dy)
        if out_dtype is not None:  # a raw op asked for another output dtype: round the reference once more
            in_dtype["out"] = in_dtype["out"].to(out_dtype)
        for name, got in zip(names, result):
            assert_contract(name, got, in_dtype[name], exact[name], truncating_stores=truncating_stores,
                            compute_dtype=compute_dtype(x, delta, base, dy))

    return judge


def _tensor_mutations(draw: Draw, tensors: dict, *, accepted=FLOATS) -> list[Mutation]:
    mutations = []
    for name, tensor in tensors.items():
        mutations += float_tensor_mutations(draw, name, tensor, accepted=accepted)
    return mutations


# --- speculators' function -------------------------------------------------------------


def grouped_dynamic_conv_case(draw: Draw) -> Case:
    shape = draw_shape(draw)
    x, delta, base, dy = draw_tensors(draw, shape)
    call = Call(dk.grouped_dynamic_conv,
                dict(hidden_states=x, delta_kernel=delta, base_kernel=base, block_size=shape.block_size,
                     group_size=shape.group_size),
                keywords=("block_size", "group_size"))
    if draw.chance(BAD_FRACTION):
        return bad_case(draw, call, public_conv_mutations(draw, shape, x, delta, base,
                                                          ("hidden_states", "delta_kernel", "base_kernel")))
    triton = shape.rows * shape.hidden <= MAX_TRITON_ELEMENTS and draw.chance(0.15)
    if triton and INTERPRETER_FAULT and not torch.cuda.is_available():
        triton = False  # an interpreter known to be wrong here (tests/triton_interpreter.py)

    def run():
        with backend("triton") if triton else contextlib.nullcontext():
            return conv_with_grads(dk.grouped_dynamic_conv, x, delta, base, dy, shape)

    kind = "valid (triton interpreter)" if triton else "valid"
    return Case(kind, run, Agrees(conv_judge(shape, x, delta, base, dy, truncating_stores=triton)),
                {**call.args, "grad": dy})


def public_conv_mutations(draw: Draw, shape: ConvShape, x, delta, base, names) -> list[Mutation]:
    """Bad arguments of speculators' signature; ``names``: what it calls x, delta, base."""
    x_name, delta_name, base_name = names
    width_names = (x_name, "hidden_size", base_name, delta_name)
    mutations = _tensor_mutations(draw, {x_name: x, delta_name: delta, base_name: base})
    mutations += size_mutations(draw, "block_size")
    mutations += size_mutations(draw, "group_size")
    mutations += [
        Mutation("hidden width changed", x_name, with_dim_resized(draw, x, -1, draw.pick([1, shape.group_size])),
                 width_names),
        Mutation("no dims", x_name, draw.randn((), x.dtype), (x_name,)),
        Mutation("group count off by one", delta_name, with_dim_resized(draw, delta, -1), (delta_name,)),
        Mutation("an extra dim", delta_name, with_extra_dim(draw, delta), (delta_name,)),
        Mutation("one tap more than base", base_name, with_dim_resized(draw, base, 0),
                 (base_name, delta_name, "kernel_size")),
        Mutation("width off by one", base_name, with_dim_resized(draw, base, 1), (base_name,)),
        Mutation("1-D", base_name, draw.randn((shape.hidden,), base.dtype), (base_name,)),
        Mutation("3-D", base_name, with_extra_dim(draw, base, 1), (base_name,)),
    ]
    if x.dim() >= 2:
        mutations.append(Mutation("rows differ from x", delta_name, with_dim_resized(draw, delta, 0), (delta_name,)))
    if shape.kernel_size > 1:
        mutations.append(Mutation("below kernel_size", "block_size", draw.integer(1, shape.kernel_size - 1),
                                  ("block_size", "kernel_size")))
    if shape.hidden:
        mutations.append(Mutation("not dividing hidden_size", "group_size", shape.hidden + 1,
                                  ("group_size", "hidden_size")))
    return mutations


# --- NeMo's signature ------------------------------------------------------------------


def nemo_case(draw: Draw) -> Case:
    block_size = draw.size(1, 8)
    lead = (draw.size(0, 4, edges=(1,)), block_size * draw.size(0, 6))
    shape = draw_shape(draw, lead=lead, block_size=block_size, allow_empty_hidden=False)
    if draw.chance(0.2):  # NeMo's decode step: K taps over a block shorter than K
        shape = dataclasses.replace(shape, kernel_size=shape.block_size + draw.integer(1, 2))
    x, delta, base, dy = draw_tensors(draw, shape)
    call = Call(dk.compat.grouped_dynamic_convolve,
                dict(hidden=x, dynamic=delta, base_kernel=base, group_size=shape.group_size,
                     block_size=shape.block_size))
    if draw.chance(BAD_FRACTION):
        mutations = _tensor_mutations(draw, {"hidden": x, "dynamic": delta, "base_kernel": base})
        mutations += size_mutations(draw, "block_size") + size_mutations(draw, "group_size")
        mutations += [
            Mutation("2-D", "hidden", with_dim_dropped(draw, x, 0), ("hidden",)),
            Mutation("sequence not a multiple of block_size", "hidden",
                     with_dim_resized(draw, x, 1, 1), ("hidden", "block_size", "dynamic")),
            Mutation("group count off by one", "dynamic", with_dim_resized(draw, delta, -1), ("dynamic",)),
            Mutation("width off by one", "base_kernel", with_dim_resized(draw, base, 1), ("base_kernel",)),
        ]
        return bad_case(draw, call, mutations)

    def run():
        return conv_with_grads(_nemo_keywords(dk.compat.grouped_dynamic_convolve), x, delta, base, dy, shape)

    return Case("valid" + (" (K > block_size)" if shape.kernel_size > shape.block_size else ""), run,
                Agrees(nemo_judge(shape, x, delta, base, dy)), {**call.args, "grad": dy})


def _nemo_keywords(fn):
    """NeMo's positional (group_size, block_size) as conv_with_grads' keywords."""
    return lambda x, delta, base, *, block_size, group_size: fn(x, delta, base, group_size, block_size)


def nemo_judge(shape: ConvShape, x, delta, base, dy):
    def judge(result) -> None:
        used, delta_used, base_used = effective(shape, x, delta, base)
        nemo = _nemo_keywords(reference.nemo_grouped_dynamic_convolve)
        in_dtype = conv_with_grads(nemo, x, delta_used, base_used, dy, used)
        exact = conv_with_grads(nemo, x.double(), delta_used.double(), base_used.to(x.dtype).double(),
                                dy.double(), used)
        pads = (None, None, -2, 0)
        for name, got, ref, e, pad in zip(("out", "dx", "ddelta", "dbase"), result, in_dtype, exact, pads):
            if pad is not None:
                ref, e = _padded_taps(ref, shape.kernel_size, pad), _padded_taps(e, shape.kernel_size, pad)
            assert_contract(name, got, ref, e)

    return judge


# --- the module ------------------------------------------------------------------------


def module_case(draw: Draw) -> Case:
    shape = draw_shape(draw, allow_empty_hidden=False)
    dtype = draw.pick([torch.float32, torch.float32, torch.bfloat16, torch.float64, torch.float16])
    lead = shape.lead
    sizes = dict(hidden_size=shape.hidden, block_size=shape.block_size, kernel_size=shape.kernel_size,
                 group_size=shape.group_size)
    h1 = draw.layout(draw.randn((*lead, shape.hidden), dtype))
    h2 = draw.layout(draw.randn((*lead, shape.hidden), dtype))
    identity = draw.chance(0.3)
    base_kernel = draw.randn((2, shape.kernel_size, shape.hidden), dtype)
    weight = draw.randn((2 * shape.kernel_size * shape.groups, shape.hidden), dtype, 0.3)
    dy1 = draw.randn((*lead, shape.hidden), dtype)
    dy2 = draw.randn((*lead, shape.hidden), dtype)

    def build(hidden_size, block_size, kernel_size, group_size):
        module = dk.GroupedDynamicCausalConv(hidden_size, block_size=block_size, kernel_size=kernel_size,
                                             group_size=group_size).to(dtype)
        if not identity:
            with torch.no_grad():
                module.base_kernel.copy_(base_kernel)
                module.kernel_projection.weight.copy_(weight)
        return module

    def prepare_and_finish(hidden_size, block_size, kernel_size, group_size, hidden_states, finish_hidden_states,
                           delta_kernel=None):
        module = build(hidden_size, block_size, kernel_size, group_size)
        out1, kernels = module.prepare(hidden_states)
        out2 = module.finish(finish_hidden_states, kernels if delta_kernel is None else delta_kernel)
        return module, out1, kernels, out2

    call = Call(prepare_and_finish, dict(**sizes, hidden_states=h1, finish_hidden_states=h2, delta_kernel=None))
    if draw.chance(BAD_FRACTION):
        return bad_case(draw, call, module_mutations(draw, shape, h1, h2))

    if identity:
        def run():
            return prepare_and_finish(**sizes, hidden_states=h1, finish_hidden_states=h2)[1:]

        return Case("valid (reset_parameters: identity)", run, Agrees(_identity_judge(shape, h1, h2)), call.args)

    def run():
        leaves = [t.detach().requires_grad_() for t in (h1, h2)]
        module = build(**sizes)
        with pinned_outputs(module.kernel_projection) as projections:
            out1, kernels = module.prepare(leaves[0])
            out2 = module.finish(leaves[1], kernels)
        params = [module.base_kernel, module.kernel_projection.weight]
        grads = torch.autograd.grad((out1 * dy1).sum() + (out2 * dy2).sum(), [*leaves, *params],
                                    materialize_grads=True)
        assert len(projections) == 1, f"prepare projected {len(projections)} inputs, not one"
        return {"out1": out1.detach(), "kernels": kernels.detach(), "out2": out2.detach(),
                "projection": projections[0].detach(), "threads": torch.get_num_threads(),
                **dict(zip(("dh1", "dh2", "dbase_kernel", "dweight"), grads))}

    return Case("valid", run, Agrees(_module_judge(shape, h1, h2, base_kernel, weight, dy1, dy2)),
                {**call.args, "dtype": dtype})


def _module_pipeline(conv, shape: ConvShape, h1, h2, base_kernel, weight, dy1, dy2, *, projection=None) -> dict:
    """prepare then finish, as the module composes them, over a given conv function.

    projection: the values kernel_projection(h1) takes [..., 2*K*G] (default: computed
    here). The judge passes the module's own: the projection is torch's GEMM, not ours,
    and two GEMM calls on equal values may round differently (MKL without conditional
    reproducibility, by operand address and thread count), which must not be charged
    to the conv.
    """
    leaves = [t.detach().requires_grad_() for t in (h1, h2, base_kernel, weight)]
    h1, h2, base_kernel, weight = leaves
    kernels = torch.nn.functional.linear(h1, weight)
    if projection is not None:
        kernels = values_of(kernels, projection)
    kernels = kernels.view(*h1.shape[:-1], 2, shape.kernel_size, shape.groups)
    out1 = conv(h1, kernels[..., 0, :, :], base_kernel[0], block_size=shape.block_size, group_size=shape.group_size)
    out2 = conv(h2, kernels[..., 1, :, :], base_kernel[1], block_size=shape.block_size, group_size=shape.group_size)
    grads = torch.autograd.grad((out1 * dy1).sum() + (out2 * dy2).sum(), leaves, materialize_grads=True)
    return {"out1": out1.detach(), "kernels": kernels[..., 1, :, :].detach(), "out2": out2.detach(),
            **dict(zip(("dh1", "dh2", "dbase_kernel", "dweight"), grads))}


def _module_judge(shape, h1, h2, base_kernel, weight, dy1, dy2):
    def judge(result) -> None:
        projection = result["projection"]
        assert_equal("prepare's kernels (side 1 of the module's projection)", result["kernels"],
                     projection.view(*h1.shape[:-1], 2, shape.kernel_size, shape.groups)[..., 1, :, :])
        # The projection's backward GEMMs with the module's threads: MKL's rounding of
        # one product can depend on its thread count (seen under MKL_CBWR=COMPATIBLE).
        with threads(result["threads"]):
            in_dtype = _module_pipeline(reference.grouped_dynamic_conv, shape, h1, h2, base_kernel, weight,
                                        dy1, dy2, projection=projection)
        exact = _module_pipeline(reference.grouped_dynamic_conv, shape,
                                 *(t.double() for t in (h1, h2, base_kernel, weight, dy1, dy2)))
        for name in ("out1", "out2", "dh1", "dh2", "dbase_kernel", "dweight"):
            assert_contract(name, result[name], in_dtype[name], exact[name])

    return judge


def _identity_judge(shape, h1, h2):
    def judge(result) -> None:
        out1, kernels, out2 = result
        assert_equal("prepare(h) after reset_parameters", out1, h1.contiguous())
        assert_equal("finish(h) after reset_parameters", out2, h2.contiguous())
        assert_equal("side-1 kernels after reset_parameters", kernels,
                     torch.zeros(*h1.shape[:-1], shape.kernel_size, shape.groups, dtype=h1.dtype))

    return judge


def module_mutations(draw: Draw, shape: ConvShape, h1, h2) -> list[Mutation]:
    mutations = []
    for name in ("hidden_size", "block_size", "kernel_size", "group_size"):
        mutations += size_mutations(draw, name)
    mutations += float_tensor_mutations(draw, "hidden_states", h1)
    mutations += [
        Mutation("hidden width off by one", "hidden_states", with_dim_resized(draw, h1, -1),
                 ("hidden_states", "hidden_size")),
        Mutation("hidden width off by one (finish)", "finish_hidden_states", with_dim_resized(draw, h2, -1),
                 ("hidden_states", "hidden_size")),
        Mutation("None (finish)", "finish_hidden_states", None, ("hidden_states",)),
        Mutation("group count off by one (finish)", "delta_kernel",
                 draw.randn((*h2.shape[:-1], shape.kernel_size, shape.groups + 1), h2.dtype), ("delta_kernel",)),
    ]
    if shape.block_size <= 64:  # a missed check would allocate [2, L + 1, H]: keep that small
        mutations.append(Mutation("kernel_size above block_size", "kernel_size", shape.block_size + 1,
                                  ("kernel_size", "block_size")))
    if shape.group_size > 1:
        mutations.append(Mutation("not dividing group_size", "hidden_size", shape.hidden + 1,
                                  ("hidden_size", "group_size")))
    return mutations


# --- the raw ops -------------------------------------------------------------------------


def conv_op_case(draw: Draw) -> Case:
    """dflash2::grouped_dynamic_conv (x, delta, base, block_size, group_size): the Python
    custom op, autograd included."""
    shape = draw_shape(draw)
    x, delta, base, dy = draw_tensors(draw, shape)
    op = torch.ops.dflash2.grouped_dynamic_conv
    call = Call(op, dict(x=x, delta=delta, base=base, block_size=shape.block_size, group_size=shape.group_size))
    if draw.chance(BAD_FRACTION):
        mutations = [_schema_named(m) for m in public_conv_mutations(draw, shape, x, delta, base,
                                                                     ("x", "delta", "base"))]
        return bad_case(draw, call, at_op_boundary(mutations))

    def run():
        return conv_with_grads(lambda a, b, c, *, block_size, group_size: op(a, b, c, block_size, group_size),
                               x, delta, base, dy, shape)

    return Case("valid", run, Agrees(conv_judge(shape, x, delta, base, dy)), {**call.args, "grad": dy})


def _schema_named(mutation: Mutation) -> Mutation:
    """The raw op's message may use its schema name (x) or the public one (hidden_states)."""
    public = {"x": "hidden_states", "delta": "delta_kernel", "base": "base_kernel"}
    extra = tuple(public[name] for name in mutation.names if name in public)
    return Mutation(mutation.label, mutation.argument, mutation.value, (*mutation.names, *extra))


def conv_backward_op_case(draw: Draw) -> Case:
    """dflash2::grouped_dynamic_conv_backward (grad_out, x, delta, base, block_size, group_size)."""
    shape = draw_shape(draw)
    x, delta, base, dy = draw_tensors(draw, shape)
    if draw.chance(0.2):  # any float gradient is readable
        dy = dy.to(draw.dtype(FLOATS))
    op = torch.ops.dflash2.grouped_dynamic_conv_backward
    call = Call(op, dict(grad_out=dy, x=x, delta=delta, base=base, block_size=shape.block_size,
                         group_size=shape.group_size))
    if draw.chance(BAD_FRACTION):
        mutations = [_schema_named(m) for m in public_conv_mutations(draw, shape, x, delta, base,
                                                                     ("x", "delta", "base"))]
        mutations += float_tensor_mutations(draw, "grad_out", dy)
        mutations += [
            Mutation("width off by one", "grad_out", with_dim_resized(draw, dy, -1), ("grad_out",)),
            Mutation("an extra dim", "grad_out", with_extra_dim(draw, dy), ("grad_out",)),
        ]
        return bad_case(draw, call, at_op_boundary(mutations))
    return Case("valid", call, Agrees(conv_judge(shape, x, delta, base, dy, names=("dx", "ddelta", "dbase"))),
                call.args)


def _flat_shape(draw: Draw, **kwargs) -> ConvShape:
    """Raw-op sizes: one row dim, at least one group, any block size (K > L allowed)."""
    rows = draw.size(0, 300, edges=(1,))
    shape = draw_shape(draw, taps_above_block=0.15, lead=(rows,), allow_empty_hidden=False, **kwargs)
    return dataclasses.replace(shape, lead=(min(rows, MAX_ELEMENTS // shape.hidden),))


def _raw_tensor_mutations(draw: Draw, shape: ConvShape, x, delta, base) -> list[Mutation]:
    """Bad operands of conv_forward_cpu / conv_backward_cpu (schema names x, delta, base)."""
    mutations = _tensor_mutations(draw, {"x": x, "delta": delta, "base": base})
    mutations += size_mutations(draw, "block_size")
    mutations += [
        Mutation("3-D", "x", with_extra_dim(draw, x), ("x",)),
        Mutation("1-D", "x", with_dim_dropped(draw, x, 0), ("x",)),
        Mutation("rows differ from x", "delta", with_dim_resized(draw, delta, 0), ("delta", "x")),
        Mutation("groups not dividing H", "delta", _non_dividing_groups(draw, shape, delta), ("delta", "x")),
        Mutation("no taps", "delta", delta[:, :0], ("delta", "base")),
        Mutation("2-D", "delta", delta[:, 0], ("delta",)),
        Mutation("taps differ from delta", "base", with_dim_resized(draw, base, 0), ("base", "delta")),
        Mutation("width off by one", "base", with_dim_resized(draw, base, 1), ("base", "x")),
    ]
    for name, tensor in (("x", x), ("delta", delta), ("base", base)):
        if tensor.shape[-1] > 1:  # a last dim of one has no stride to get wrong
            mutations.append(Mutation("non-unit last stride", name, last_strided(tensor), (name,)))
    return mutations


def last_strided(tensor: torch.Tensor) -> torch.Tensor:
    """The same values with last stride 2."""
    wide = torch.zeros(*tensor.shape[:-1], 2 * tensor.shape[-1], dtype=tensor.dtype)
    wide[..., ::2] = tensor
    return wide[..., ::2]


def _non_dividing_groups(draw: Draw, shape: ConvShape, delta: torch.Tensor) -> torch.Tensor:
    groups = next(g for g in range(shape.hidden + 1, 4 * shape.hidden + 2) if shape.hidden % g)
    return draw.randn((delta.shape[0], delta.shape[1], groups), delta.dtype)


def conv_forward_cpu_case(draw: Draw) -> Case:
    """dflash2::conv_forward_cpu (x [N, H], delta [N, K, G], base [K, H], block_size, out_dtype)."""
    shape = _flat_shape(draw)
    x, delta, base, dy = draw_tensors(draw, shape, unit_last_stride=True)
    out_dtype = shape.out_dtype if draw.chance(0.6) else draw.dtype(FLOATS)
    call = Call(torch.ops.dflash2.conv_forward_cpu,
                dict(x=x, delta=delta, base=base, block_size=shape.block_size, out_dtype=out_dtype))
    if draw.chance(BAD_FRACTION):
        mutations = _raw_tensor_mutations(draw, shape, x, delta, base)
        mutations += dtype_argument_mutations(draw, "out_dtype", FLOATS)
        return bad_case(draw, call, at_op_boundary(mutations))
    return Case("valid" + (" (K > block_size)" if shape.kernel_size > shape.block_size else ""), lambda: (call(),),
                Agrees(conv_judge(shape, x, delta, base, dy, names=("out",), out_dtype=out_dtype)), call.args)


def conv_backward_cpu_case(draw: Draw) -> Case:
    """dflash2::conv_backward_cpu (grad_out [N, H], x, delta, base, block_size) -> (dx, ddelta, dbase)."""
    shape = _flat_shape(draw)
    x, delta, base, dy = draw_tensors(draw, shape, unit_last_stride=True)
    if draw.chance(0.2):
        dy = dy.to(draw.dtype(FLOATS))
    call = Call(torch.ops.dflash2.conv_backward_cpu,
                dict(grad_out=dy, x=x, delta=delta, base=base, block_size=shape.block_size))
    if draw.chance(BAD_FRACTION):
        mutations = _raw_tensor_mutations(draw, shape, x, delta, base)
        mutations += float_tensor_mutations(draw, "grad_out", dy)
        mutations += [
            Mutation("width off by one", "grad_out", with_dim_resized(draw, dy, -1), ("grad_out",)),
        ]
        if dy.shape[-1] > 1:
            mutations.append(Mutation("non-unit last stride", "grad_out", last_strided(dy), ("grad_out",)))
        return bad_case(draw, call, at_op_boundary(mutations))
    return Case("valid" + (" (K > block_size)" if shape.kernel_size > shape.block_size else ""), call,
                Agrees(conv_judge(shape, x, delta, base, dy, names=("dx", "ddelta", "dbase"))), call.args)
