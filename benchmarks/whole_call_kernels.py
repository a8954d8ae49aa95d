"""What each GPU kernel of this package moves in one launch, from the launch's own
tensors: the two registries the whole-call model (benchmarks/fake_cuda.py) reads.

- :data:`TRITON`: Triton kernel name -> ``fn(launch) -> (bytes read, bytes written)``,
  ``launch`` a ``dflash2_kernels.conv.launch.KernelLaunch`` (its ``args`` hold the tensors).
- :data:`CUDA_OPS`: C++ op name (``dflash2::NAME``) -> ``fn(args, outputs) -> [Work]``:
  the ``__global__`` kernels its CUDA binding (csrc/*_cuda.cpp -> csrc/kernels/*.cu)
  launches, in order, and the ATen calls the binding makes around them (zero-filled
  allocations, sorts, copies of non-contiguous inputs). ``args`` maps the schema's
  argument names to the values of the call.

One of our kernels moves: reads = (its minimum in benchmarks/traffic_minimum.py - the
outputs that minimum writes) x its budget ratio (traffic_minimum.BUDGETS: the ceiling
tests/test_traffic.py and tests/emulated hold its counted bytes to: the unique ratio,
or the requested one where the budget says re-reads come from HBM); writes = the output
buffers it fills. With fake tensors no id is known, so where a minimum counts the
distinct codebook rows ids select, every id is taken to be distinct (at most V rows):
an upper bound. A gathered or scattered element costs a whole 32-byte sector.

A kernel without an entry: every tensor argument read once, nothing written, and the
model marks it unmodelled. To add one::

    @triton_kernel("my_kernel")
    def _(launch):
        a = launch.args
        return nbytes(a["x_ptr"]), nbytes(a["out_ptr"])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import traffic_minimum as minimum
from traffic_counters import SECTOR
from traffic_minimum import nbytes

TRITON: dict[str, Callable] = {}
CUDA_OPS: dict[str, Callable] = {}

# The H200 the model runs on (fake_cuda.H200): the serving top-k splits rows by it.
MULTIPROCESSORS = 132


def triton_kernel(name: str):
    """Register ``fn(launch) -> (read, written)`` for the Triton kernel ``name``."""
    def register(fn):
        TRITON[name] = fn
        return fn
    return register


def cuda_op(name: str):
    """Register ``fn(args, outputs) -> [Work]`` for the C++ op ``dflash2::name``."""
    def register(fn):
        CUDA_OPS[name] = fn
        return fn
    return register


@dataclass(frozen=True)
class Work:
    """One device launch inside a C++ op: ``kind`` "cuda" (ours) or "aten" (an ATen call
    of the binding); ``touches``: tensors (or meta stand-ins) it reads or writes, for the
    caller's plane predicate."""

    kind: str
    name: str
    read: int
    write: int
    touches: tuple = ()


def unmodelled_bytes(launch) -> tuple[int, int]:
    """The fallback: every tensor argument read once."""
    return sum(nbytes(v) for v in launch.args.values() if isinstance(v, torch.Tensor)), 0


def ratio(key: str) -> float:
    budget = minimum.budget_for(key)
    return budget.requested if budget.dram == "requested" else budget.unique


def _budgeted(key: str, minimum_bytes: int, minimum_writes: int, writes: int) -> tuple[int, int]:
    return round((minimum_bytes - minimum_writes) * ratio(key)), writes


def _kernel(key: str, minimum_bytes: int, minimum_writes: int, writes: int | None = None, touches=()) -> Work:
    read, write = _budgeted(key, minimum_bytes, minimum_writes, minimum_writes if writes is None else writes)
    return Work("cuda", minimum.kernel_name(key), read, write, touches)


def _aten(name: str, read: int, write: int, *touches) -> Work:
    return Work("aten", name, read, write, touches)


def _copy_if_strided(tensor: torch.Tensor | None, *, when: bool = True) -> list[Work]:
    """``t.contiguous()`` in a binding: a copy only when the tensor is not contiguous."""
    if tensor is None or not when or tensor.is_contiguous():
        return []
    return [_aten("clone", nbytes(tensor), tensor.numel() * tensor.element_size(), tensor)]


# --- the conv (Triton) ----------------------------------------------------------------------


@triton_kernel("grouped_dynamic_conv_fwd_kernel")
def _conv_forward(launch) -> tuple[int, int]:
    a = launch.args
    need = minimum.conv_forward(a["x_ptr"], a["delta_ptr"], a["base_ptr"], a["out_ptr"], a["block_size"])
    key = "grouped_dynamic_conv_fwd_kernel"
    return _budgeted(key, need.kernels[key], nbytes(a["out_ptr"]), nbytes(a["out_ptr"]))


@triton_kernel("grouped_dynamic_conv_bwd_kernel")
def _conv_backward(launch) -> tuple[int, int]:
    a = launch.args
    dx, ddelta, partials = a["dx_ptr"], a["ddelta_ptr"], a["dbase_partial_ptr"]
    need = minimum.conv_backward(a["dy_ptr"], a["x_ptr"], a["delta_ptr"], a["base_ptr"], dx, ddelta[0], None,
                                 a["block_size"])
    key = "grouped_dynamic_conv_bwd_kernel"
    # The minimum writes one fp64 dbase partial; the launch writes one per row chunk.
    minimum_writes = nbytes(dx) + nbytes(ddelta[0]) + partials[0].numel() * 8
    return _budgeted(key, need.kernels[key], minimum_writes, nbytes(dx) + nbytes(ddelta) + nbytes(partials))


@triton_kernel("grouped_dynamic_conv_dbase_kernel")
def _conv_dbase(launch) -> tuple[int, int]:
    a = launch.args
    partials, dbase = a["partial_ptr"], a["dbase_ptr"]
    return nbytes(partials), nbytes(dbase)


# --- the selector (csrc/selector_cuda.cpp, csrc/kernels/selector_kernels.cu) ------------------


def _rows(count: int, vocab: int) -> int:
    """Distinct codebook rows that ``count`` ids select, at most: every id distinct."""
    return min(count, vocab)


def _selector_shape(a: dict):
    codebook = a["predecessor_codebook"]
    vocab, rank = codebook.shape
    rows, top_k = a["candidate_ids"].shape
    row_bytes = rank * codebook.element_size()
    return rows, top_k, vocab, rank, row_bytes


@cuda_op("selector_scores")
def _selector_scores(a: dict, scores) -> list[Work]:
    rows, top_k, vocab, rank, row_bytes = _selector_shape(a)
    unary = a["unary"]
    gathered_unary = nbytes(unary) if a["unary_gathered"] else rows * top_k * SECTOR
    need = (nbytes(a["projected"]) + nbytes(a["predecessor_ids"]) + nbytes(a["candidate_ids"])
            + (_rows(rows, vocab) + _rows(rows * top_k, vocab)) * row_bytes + gathered_unary + nbytes(scores))
    return [*_copy_if_strided(a["predecessor_ids"]), *_copy_if_strided(a["candidate_ids"]),
            _kernel("selector_scores_forward_kernel", need, nbytes(scores), touches=(unary,))]


@cuda_op("selector_scores_backward")
def _selector_scores_backward(a: dict, outputs) -> list[Work]:
    d_unary, d_projected, d_predecessor, d_successor = outputs
    rows, top_k, vocab, rank, row_bytes = _selector_shape(a)
    grad, projected, pred, cand = a["grad_scores"], a["projected"], a["predecessor_ids"], a["candidate_ids"]
    gathered = a["unary_gathered"]
    accumulator = 8 if a["predecessor_codebook"].dtype == torch.float64 else 4
    a_rows, b_rows = _rows(rows, vocab) * row_bytes, _rows(rows * top_k, vocab) * row_bytes
    pg = rows * rank * accumulator  # P * g, handed from the row pass to the predecessors' sums
    chunks = -(-rows // 64), -(-(rows * top_k) // 64)  # kSegmentChunk (csrc/kernels/selector.cuh)
    partials = [c * 2 * rank * accumulator for c in chunks]
    work = [*_copy_if_strided(grad), *_copy_if_strided(pred), *_copy_if_strided(cand)]
    # allocate_selector_gradients (csrc/selector_checks.h): dU a copy of dS, or [N, V] zeros
    # written only at the candidates; dA and dB zeros written only at the rows ids reach.
    if gathered:
        work.append(_aten("_to_copy", nbytes(grad), nbytes(d_unary), d_unary))
    else:
        work.append(_aten("zeros", 0, nbytes(d_unary), d_unary))
    work += [_aten("zeros", 0, nbytes(d_predecessor), d_predecessor),
             _aten("zeros", 0, nbytes(d_successor), d_successor)]
    # Stable sorts of the ids (one aten call each; a GPU radix sort is several kernels).
    work += [_aten("sort", nbytes(pred), 2 * nbytes(pred), pred), _aten("sort", nbytes(cand), 2 * nbytes(cand), cand)]
    scattered_unary = 0 if gathered else rows * top_k * SECTOR
    ids = nbytes(pred) + nbytes(cand)
    rows_written = nbytes(d_projected) + pg + scattered_unary
    rows_pass = ids + nbytes(grad) + nbytes(projected) + a_rows + b_rows + rows_written
    predecessors = 2 * nbytes(pred) + pg + a_rows
    successors = 2 * nbytes(cand) + nbytes(pred) + nbytes(grad) + a_rows + nbytes(projected) + b_rows
    carries = [2 * 8 * max(1, c) for c in chunks]
    work += [
        _kernel("selector_backward_rows_kernel", rows_pass, rows_written, touches=(d_unary,)),
        _kernel("selector_segment_chunks_kernel[predecessors]", predecessors, a_rows, a_rows + partials[0]),
        _kernel("selector_segment_carry_kernel[predecessors]", carries[0] + partials[0], 0),
    ]
    if rows * top_k:
        work += [
            _kernel("selector_segment_chunks_kernel[successors]", successors, b_rows, b_rows + partials[1]),
            _kernel("selector_segment_carry_kernel[successors]", carries[1] + partials[1], 0),
        ]
    return work


# --- serving (csrc/serving_cuda.cpp, csrc/kernels/serving_kernels.cu, verify_kernels.cu) -----


def topk_slices(rows: int, vocab: int) -> int:
    """plan_topk_split (csrc/kernels/serving_kernels.cu) on the H200: vocabulary slices a row."""
    slices = max(1, -(-(MULTIPROCESSORS * 32) // max(rows, 1)))
    slices = min(slices, 256, max(1, vocab // 1024))  # kMaxSlices, kMinSliceLength
    length = -(-vocab // slices)
    length = -(-length // 16) * 16
    return -(-vocab // length)


@cuda_op("candidate_topk")
def _candidate_topk(a: dict, outputs) -> list[Work]:
    logits, top_k = a["logits"], a["top_k"]
    values, ids = outputs
    rows, vocab = logits.shape
    slices = topk_slices(rows, vocab)
    need = minimum.candidate_topk(logits, values, ids, slices).kernels
    partials = minimum.topk_partials_bytes(rows, vocab, top_k, slices)
    written = nbytes(values) + nbytes(ids)
    return [_kernel("topk_partial_kernel", need["topk_partial_kernel"], partials, touches=(logits,)),
            _kernel("topk_merge_kernel", need["topk_merge_kernel"], written)]


@cuda_op("select_path")
def _select_path(a: dict, outputs) -> list[Work]:
    logits, projected = a["logits"], a["projected"]
    path, candidate_ids, draft_probs, edges = outputs
    batch, draft, vocab = logits.shape
    codebook = a["predecessor_codebook"]
    row_bytes = codebook.shape[1] * codebook.element_size()
    top_k = a["top_k"]
    sampled = a["temperature"] > 0
    slices = topk_slices(batch * draft, vocab)
    partials = minimum.topk_partials_bytes(batch * draft, vocab, top_k, slices)
    counters = batch * 4
    a_rows = _rows(batch + batch * (draft - 1) * top_k, vocab) * row_bytes  # the anchor, then candidates
    b_rows = _rows(batch * draft * top_k, vocab) * row_bytes
    written = nbytes(path) + nbytes(candidate_ids) + nbytes(draft_probs) + nbytes(edges)
    shared = (nbytes(projected) + a_rows + b_rows + nbytes(a["anchor_ids"])
              + (nbytes(a["uniforms"]) if sampled else 0) + written)
    return [*_copy_if_strided(projected), *_copy_if_strided(a["anchor_ids"]),
            *_copy_if_strided(a["uniforms"], when=sampled),
            _kernel("topk_partial_kernel", nbytes(logits) + partials + counters, partials + counters,
                    touches=(logits,)),
            _kernel("select_path_kernel", partials + shared + 2 * counters, written)]


@cuda_op("rejection_sample")
def _rejection_sample(a: dict, outputs) -> list[Work]:
    accepted, bonus = outputs
    batch = a["draft_tokens"].shape[0]
    vocab = a["target_probs"].shape[-1]
    slices = -(-vocab // 4096)  # kVerifySliceLength (csrc/kernels/serving.cuh)
    need = minimum.rejection_sample(a["draft_tokens"], a["target_probs"], a["draft_probs"], a["candidate_ids"],
                                    a["uniforms"], accepted, bonus, slices).kernels
    masses = batch * slices * 2 * 4
    copies = [w for name in ("draft_tokens", "draft_probs", "candidate_ids", "uniforms")
              for w in _copy_if_strided(a[name])]
    return [*copies,
            _kernel("verify_mass_kernel", need["verify_mass_kernel"], masses + nbytes(accepted),
                    touches=(a["target_probs"],)),
            _kernel("verify_bonus_kernel", need["verify_bonus_kernel"], nbytes(bonus))]


# --- the draft head's GPU driver (Triton: dflash2_kernels/head/gpu_launch.py) -----------------
# Each launch's own arguments give its chunk (rows = programs over the segments); the
# minima are traffic_minimum's head_*, the ratios the budgets tests/test_traffic.py holds
# the interpreter's counts of these kernels to.


def _entry_bytes(launch) -> int:
    return launch.args["logits_ptr"].element_size()


def _head_chunk(launch, rows: int, top_k: int, *, labels: bool = False, losses: int = 0,
                plane_losses: int = 0, plane_bytes: int = 4, logits_bytes: int = 4):
    a, c = launch.args, launch.constexprs
    return minimum.HeadChunk(rows, a["vocab"], max(a["n_segments"], 1), top_k, bool(c["HAS_TARGET"]), labels, losses,
                             plane_losses, plane_bytes, _entry_bytes(launch), logits_bytes,
                             1 if c.get("KEY_BITS", 32) == 32 else 2)


@triton_kernel("draft_head_scan_kernel")
def _head_scan(launch) -> tuple[int, int]:
    a, c = launch.args, launch.constexprs
    rows = launch.programs // a["n_segments"]
    chunk = _head_chunk(launch, rows, a["top_k"] if c["CANDIDATES"] else 0)
    return _budgeted("draft_head_scan_kernel", minimum.head_scan(chunk), chunk.handed_over(), chunk.handed_over())


@triton_kernel("draft_head_merge_kernel")
def _head_merge(launch) -> tuple[int, int]:
    a, c = launch.args, launch.constexprs
    top_k = a["top_k"] if c["TOPK"] else 0
    chunk = _head_chunk(launch, launch.programs, top_k, labels=bool(c["HAS_LABELS"]),
                        logits_bytes=a["topk_logits_ptr"].element_size())
    return _budgeted("draft_head_merge_kernel", minimum.head_merge(chunk), chunk.row_outputs(), chunk.row_outputs())


@triton_kernel("draft_head_sweep_kernel")
def _head_sweep(launch) -> tuple[int, int]:
    a, c = launch.args, launch.constexprs
    rows = launch.programs // a["n_segments"]
    losses = bin(c["LOSS_MASK"]).count("1")
    plane_bytes = a["planes_ptr"].element_size()
    if c["GRADS"] == 2:
        chunk = _head_chunk(launch, rows, a["top_k"], losses=losses, plane_bytes=plane_bytes)
        sparse = (a["top_k"] + 1) * chunk.entry_bytes * int(c["SPARSE_OUT"])
        written = rows * (a["vocab"] * plane_bytes + sparse)
        need = minimum.head_sweep_backward(chunk, bool(c["SPARSE_OUT"]))
        return _budgeted("draft_head_sweep_kernel[backward]", need, written, written)
    planes = bin(c["PLANE_MASK"]).count("1") if c["GRADS"] == 1 else 0
    chunk = _head_chunk(launch, rows, 0, losses=losses, plane_losses=planes, plane_bytes=plane_bytes)
    written = rows * (planes * a["vocab"] * plane_bytes + chunk.segments * 48 * int(c["SUMS"]))
    return _budgeted("draft_head_sweep_kernel[forward]", minimum.head_sweep_forward(chunk), written, written)


@triton_kernel("draft_head_sparse_add_kernel")
def _head_sparse_add(launch) -> tuple[int, int]:
    a = launch.args
    rows, top_k = launch.programs, a["top_k"]
    written = rows * (top_k + 1) * a["plane_ptr"].element_size()
    need = minimum.head_sparse_add(rows, top_k, a["sparse_ptr"].element_size(), a["plane_ptr"].element_size())
    return _budgeted("draft_head_sparse_add_kernel", need, written, written)


@triton_kernel("draft_head_finish_kernel")
def _head_finish(launch) -> tuple[int, int]:
    a, c = launch.args, launch.constexprs
    need = minimum.head_finish(launch.programs, a["n_segments"], c["LOSS_MASK"], bool(c["HAS_TARGET"]))
    read = launch.programs * (a["n_segments"] * 8 + 8)  # a lower bound of its reads: the overlap column
    return _budgeted("draft_head_finish_kernel", need, need - read, need - read)


@triton_kernel("draft_head_hidden_grad_kernel")
def _head_hidden_grad(launch) -> tuple[int, int]:
    a, c = launch.args, launch.constexprs
    rows = launch.programs // a["h_tiles"]
    out = a["out_ptr"]
    need = minimum.head_hidden_grad(rows, a["width"], c["LOSSES"], a["top_k"] if c["HAS_GRAD_TOPK"] else 0,
                                    a["topk_z_ptr"].element_size(), a["weight_ptr"].element_size(),
                                    out.element_size())
    return _budgeted("draft_head_hidden_grad_kernel", need, nbytes(out), nbytes(out))


@triton_kernel("draft_head_topk_kernel")
def _head_radix_topk(launch) -> tuple[int, int]:
    a = launch.args
    written = launch.programs * a["top_k"] * 16
    need = minimum.head_radix_topk(launch.programs, a["vocab"], a["top_k"], a["values_ptr"].element_size())
    return _budgeted("draft_head_topk_kernel", need, written, written)


@triton_kernel("draft_head_shard_pack_kernel")
def _head_shard_pack(launch) -> tuple[int, int]:
    a, c = launch.args, launch.constexprs
    written = launch.programs * (2 * c["KW"] + 4) * 8
    need = minimum.head_shard_pack(launch.programs, a["n_segments"], c["KW"], bool(c["HAS_TARGET"]),
                                   _entry_bytes(launch), 1 if c["KEY_BITS"] == 32 else 2)
    return _budgeted("draft_head_shard_pack_kernel", need, written, written)


@triton_kernel("draft_head_shard_merge_kernel")
def _head_shard_merge(launch) -> tuple[int, int]:
    a, c = launch.args, launch.constexprs
    top_k = a["top_k"]
    written = launch.programs * (top_k * 8 + 72 + (2 * top_k + 1) * 8)
    need = minimum.head_shard_merge(launch.programs, a["world"], c["KW"], top_k, bool(c["HAS_TARGET"]),
                                    bool(c["HAS_LABELS"]), _entry_bytes(launch))
    return _budgeted("draft_head_shard_merge_kernel", need, written, written)


@triton_kernel("draft_head_shard_shares_kernel")
def _head_shard_shares(launch) -> tuple[int, int]:
    a = launch.args
    written = launch.programs * 48
    need = minimum.head_shard_shares(launch.programs, a["n_segments"], a["top_k"])
    return _budgeted("draft_head_shard_shares_kernel", need, written, written)


@triton_kernel("draft_head_shard_final_kernel")
def _head_shard_final(launch) -> tuple[int, int]:
    a, c = launch.args, launch.constexprs
    top_k = a["top_k"]
    losses = bin(c["LOSS_MASK"]).count("1")
    need = minimum.head_shard_final(launch.programs, losses, top_k, a["topk_z_ptr"].element_size(),
                                    a["topk_logits_ptr"].element_size(), bool(c["HAS_TARGET"]))
    read = launch.programs * ((6 + 2 * top_k + 1) * 8 + 8)
    return _budgeted("draft_head_shard_final_kernel", need, need - read, need - read)
