"""What every GPU kernel of the package must move at least, what it may move at most, and
the H200 roofline model that turns bytes into time. One place for all of it.

The minimum of an op is what its formula must read once and write once: its inputs
(only the elements the formula uses: the rows of a codebook that ids select, the taps
inside a draft block), its outputs and the tensors it saves. The minimum of one kernel
of a multi-kernel op adds the intermediates it hands to the next kernel (the top-k's
per-slice partial lists, the selector's per-row terms), named where they are made.
The functions below take the tensors of one call and return exact bytes.

The budget of a kernel (:data:`BUDGETS`) bounds what the traffic counters
(benchmarks/traffic_counters.py) count for it:
- unique bytes (every byte the grid reads or writes, counted once) <= ``unique`` x
  its minimum: 1.15 unless the budget says why it needs more;
- requested bytes (each request's bytes, a re-read counted again) <= ``requested`` x
  its minimum: a kernel that reads an input twice (a second pass, a shifted tap) says
  so here, and a new second read breaks its budget;
- sectors per request at the ideal of the access pattern (a request whose lanes step
  by one constant, coalesced or strided, ideally fills whole sectors; a gather through
  indices needs what it touches) within ``sectors`` x (misaligned row starts).

The model (:func:`kernel_seconds`): a kernel's time on an H200 is the larger of its DRAM
bytes / 4.3 TB/s (the device-to-device copy, read + write, measured on the GPU test
machine: DESIGN.md) and its FLOPs / peak, but at least one launch gap. DRAM bytes are its
unique bytes in whole sectors (every sector fetched from HBM once, re-reads served by
the 50 MB L2), except for a kernel whose budget says its re-reads miss the cache (then
its requested bytes). A model, not a measurement: scripts/gpu_check.sh times the kernels
beside it when a GPU is there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from traffic_counters import tensor_bytes

# --- the H200 model ----------------------------------------------------------------------

HBM_BYTES_PER_S = 4.3e12  # device copy, read + write: measured on the GPU test machine (DESIGN.md)
MATMUL_FLOPS_PER_S = {  # dense matrix products
    torch.bfloat16: 790e12,  # measured there (DESIGN.md)
    torch.float16: 790e12,  # assumed equal to bf16 (not measured)
    torch.float32: 67e12,  # NVIDIA's H100/H200 SXM FP32 figure, not measured (torch's default: no TF32)
    torch.float64: 67e12,  # NVIDIA's FP64 tensor-core figure, not measured
}
LAUNCH_FLOOR_S = 3e-6  # assumed: the shortest a kernel takes back to back on a stream, not measured
MODEL_NOTE = ("model, not a measurement: bytes counted on the CPU (SIMT emulator / Triton interpreter / aten "
              "dispatch), time = max(DRAM bytes / 4.3 TB/s, FLOPs / peak, 3 us) per kernel")


def kernel_seconds(dram_bytes: float, flops: float = 0.0, dtype: torch.dtype = torch.float32) -> float:
    """The model's time of one kernel on an H200."""
    peak = MATMUL_FLOPS_PER_S.get(dtype, MATMUL_FLOPS_PER_S[torch.float32])
    return max(dram_bytes / HBM_BYTES_PER_S, flops / peak, LAUNCH_FLOOR_S)


# --- budgets -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Budget:
    """How far a kernel's counted traffic may exceed its minimum, and why."""

    unique: float = 1.15
    requested: float = 1.15
    sectors: float = 1.0  # touched sectors / ideal sectors
    dram: str = "unique"  # "unique": re-reads hit the L2; "requested": they come from HBM
    why: str = ""


# The selector's carry passes (one for each codebook).
_CARRY = Budget(unique=2.0, requested=4.0,
                why="latency-bound: reads the sorted ids at its chunk's edges (a few words a chunk)")

def kernel_name(key: str) -> str:
    """The kernel a key names: ``name[variant]`` (one kernel launched in several roles or
    modes) -> ``name``."""
    return key.split("[", 1)[0]


BUDGETS = {
    "grouped_dynamic_conv_fwd_kernel": Budget(
        requested=1.6,
        why="each of the K = 2 taps loads its own shifted copy of x (row n - tap): x is requested twice, the "
            "second time from the L1/L2"),
    "grouped_dynamic_conv_dbase_kernel": Budget(
        why="reads each fp64 partial once and writes dbase: its minimum"),
    "grouped_dynamic_conv_bwd_kernel": Budget(
        requested=1.7,
        why="dx gathers dy and delta of row m + tap and ddelta reads x of row n - tap: dy and x are requested "
            "twice (K = 2; 5.25 / 3.25 of the minimum), the second from the L1/L2; base is reloaded per row step; "
            "dbase is written as one fp64 partial per row chunk"),
    "draft_head_scan_kernel": Budget(
        sectors=1.1,
        why="one read of each plane; the candidates are stored compacted at data-dependent positions (a few "
            "sectors a segment), the partials as scalars"),
    "draft_head_merge_kernel": Budget(
        unique=1.5, requested=1.5, sectors=4.0,
        why="the scan hands over up to 2K candidates a segment (its bar admits ties and near misses; the minimum "
            "counts K); per row scalar loads and stores: the top-k ids it stores are read back for their logits, "
            "each logit gathered from the planes a whole sector (latency-bound: R programs)"),
    "draft_head_sweep_kernel[forward]": Budget(
        sectors=1.1,
        why="one read of each plane and one write of each gradient plane; the row's statistics are scalar loads"),
    "draft_head_sweep_kernel[backward]": Budget(
        sectors=1.1,
        why="one read of each plane and one write of dL/ds; the top-k ids are read again by the segments that hold "
            "one of them"),
    "draft_head_sparse_add_kernel": Budget(
        sectors=8.0, why="per row K + 1 scalar read-modify-writes of plane entries at their ids, a sector each "
                         "(latency-bound: R programs of K + 1 steps)"),
    "draft_head_finish_kernel": Budget(
        sectors=4.0, why="per row scalar stores of the losses and row sums (latency-bound: R programs)"),
    "draft_head_hidden_grad_kernel": Budget(
        sectors=1.2, why="the K + 1 W rows are gathers by id, each a whole row slice"),
    "draft_head_topk_kernel": Budget(
        requested=5.2, sectors=1.02, dram="requested",
        why="a radix select (K above the candidates' 64): one pass over the row per 8-bit digit of the 32-bit "
            "keys, then one to collect (5 / 1 of the minimum, whatever K is); a row is 1 MB (V = 248,320 fp32) and "
            "hundreds are in flight, so the re-reads come from HBM; the K keys are written beside the K ids for "
            "the final sort"),
    "draft_head_shard_pack_kernel": Budget(
        unique=1.5, requested=1.6, sectors=4.0,
        why="the scan hands over up to 2K candidates a segment (the minimum counts K); per row scalar loads and "
            "stores: the picked ids it stores are read back for their logits (gathers, a sector each)"),
    "draft_head_shard_merge_kernel": Budget(
        requested=1.3, sectors=4.0,
        why="per row: the ranks' packs as [W, KW] tiles, the merged ids stored then read back for this rank's "
            "logits (gathers, a sector each)"),
    "draft_head_shard_shares_kernel": Budget(sectors=4.0, why="per row scalar stores of the six shares"),
    "draft_head_shard_final_kernel": Budget(
        sectors=4.0, why="per row scalar loads and stores of the shares and the outputs (latency-bound)"),
    "selector_scores_forward_kernel": Budget(
        sectors=1.05,
        why="U at the candidates and the candidates' B rows are gathers (one sector per gathered element)"),
    "selector_backward_rows_kernel": Budget(
        requested=1.25, sectors=1.25,
        why="a lane re-reads the k candidate ids and dS of its row per rank slice (broadcasts, from the L1); "
            "with 16-bit codebooks a lane's 8 fp32 terms P * g are two 16-byte stores 32 bytes apart (each "
            "request half-fills its sectors, the pair fills them); dU is a scatter"),
    "selector_segment_chunks_kernel[predecessors]": Budget(
        sectors=2.0,
        why="with 16-bit codebooks a lane's 8 fp32 terms P * g are two 16-byte loads 32 bytes apart (each request "
            "half-fills its sectors, the pair fills them)"),
    "selector_segment_carry_kernel[predecessors]": _CARRY,
    "selector_segment_chunks_kernel[successors]": Budget(
        requested=6.0,
        why="each of a row's k candidate entries re-reads its row's A[pred] and P (sorted by candidate, rows "
            "repeat in any order): k-fold requests, unique once (P and A's used rows stay in the L2)"),
    "selector_segment_carry_kernel[successors]": _CARRY,
    "topk_partial_kernel": Budget(),
    "topk_merge_kernel": Budget(
        requested=1.3, why="a merge warp re-reads nothing; lanes past the last entry read the padding"),
    "select_path_kernel": Budget(
        requested=2.2,
        why="block t merges the partial lists of rows t - 1 and t (each list is read by two blocks); the walk "
            "reads back the edges its sequence's blocks wrote"),
    "verify_mass_kernel": Budget(
        requested=2.5,
        why="every vocabulary slice's block redoes the accepted-prefix test (D tokens, their proposals and "
            "target probabilities: latency, not bandwidth)"),
    "verify_bonus_kernel": Budget(
        sectors=1.1,
        why="reads the chosen slice of the bonus row again (the mass pass read it; from the L2); the slices' "
            "(residual, target) mass pairs are read as two 4-byte loads 8 bytes apart (B x 61 pairs at V = "
            "248,320: latency-bound)"),
    # The planted-regression probes of the tests (csrc/emulation/traffic_probe_kernels.cpp).
    "traffic_probe_kernel": Budget(),
}


def budget_for(key: str) -> Budget:
    return BUDGETS[key]


def check(launch, minimum_bytes: int, budget: Budget, label: str = "") -> list[str]:
    """What of one launch's counted traffic breaks its budget (empty: within it)."""
    label = label or launch.kernel
    problems = []
    if minimum_bytes <= 0:
        return [f"{label}: a minimum of {minimum_bytes} bytes"]
    unique = launch.unique_bytes / minimum_bytes
    if unique > budget.unique:
        problems.append(f"{label}: unique bytes {launch.unique_bytes} = {unique:.3f} x the minimum {minimum_bytes} "
                        f"(budget {budget.unique})")
    requested = launch.requested_bytes / minimum_bytes
    if requested > budget.requested:
        problems.append(f"{label}: requested bytes {launch.requested_bytes} = {requested:.3f} x the minimum "
                        f"{minimum_bytes} (budget {budget.requested})")
    excess = launch.requests.sector_excess
    if excess > budget.sectors:
        problems.append(f"{label}: {launch.requests.sectors_per_request:.2f} sectors per request against an ideal "
                        f"of {launch.requests.ideal_sectors_per_request:.2f} ({excess:.3f} x, budget {budget.sectors})")
    return problems


def dram_bytes(launch, budget: Budget) -> int:
    """The model's HBM bytes of one launch."""
    return launch.requested_bytes if budget.dram == "requested" else launch.unique_sector_bytes


# --- minimum bytes, per op -----------------------------------------------------------------


def nbytes(t: torch.Tensor | None) -> int:
    """Bytes of the distinct elements a tensor addresses (a broadcast dim counts once); 0 for None."""
    return 0 if t is None else tensor_bytes(t)


def _rows_reached(rows: int, block_size: int, tap: int) -> int:
    """How many of rows 0..rows-1 sit at a block position >= tap (they read tap `tap`)."""
    full, rest = divmod(rows, block_size)
    return full * max(0, block_size - tap) + max(0, rest - tap)


def _distinct_rows(ids: torch.Tensor, vocab: int) -> int:
    ids = ids.reshape(-1)
    ids = ids[(ids >= 0) & (ids < vocab)]
    return int(torch.unique(ids).numel())


@dataclass
class Minimum:
    """Minimum bytes of one op call: the op's (its formula's) and each kernel's."""

    op: int
    kernels: dict  # kernel key -> bytes


def conv_forward(x, delta, base, out, block_size) -> Minimum:
    """out = sum_tau (round(base[tau]) + delta[:, tau]) * x[n - tau]: x, the delta entries of
    taps inside a block, base and out, once (the kernel rounds base to x's dtype as it loads it)."""
    rows = x.shape[0]
    taps, groups = delta.shape[1], delta.shape[2]
    used_delta = sum(_rows_reached(rows, block_size, tap) for tap in range(taps)) * groups * delta.element_size()
    common = nbytes(x) + used_delta + nbytes(out)
    return Minimum(common + nbytes(base), {"grouped_dynamic_conv_fwd_kernel": common + nbytes(base)})


def conv_backward(dy, x, delta, base, dx, ddelta, dbase, block_size, chunks: int = 1) -> Minimum:
    """dx, ddelta, dbase from dy, x, the used delta entries and base: each once (ddelta and
    dbase written whole). The gradient kernel writes dbase as fp64 partials per row chunk,
    one of which is its minimum; the dbase kernel reads the ``chunks`` partials once and
    writes dbase."""
    rows = x.shape[0]
    taps, groups = delta.shape[1], delta.shape[2]
    used_delta = sum(_rows_reached(rows, block_size, tap) for tap in range(taps)) * groups * delta.element_size()
    common = nbytes(dy) + nbytes(x) + used_delta + nbytes(dx) + nbytes(ddelta)
    kernel = common + nbytes(base) + base.numel() * 8
    reduce = chunks * base.numel() * 8 + base.numel() * base.element_size()
    return Minimum(common + nbytes(base) + base.numel() * base.element_size(),
                   {"grouped_dynamic_conv_bwd_kernel": kernel, "grouped_dynamic_conv_dbase_kernel": reduce})


def _selector_rows(projected, predecessor_codebook, successor_codebook, predecessor_ids, candidate_ids) -> int:
    """P, the A rows the predecessors select, the B rows the candidates select and the ids."""
    vocab, rank = predecessor_codebook.shape
    row_bytes = rank * predecessor_codebook.element_size()
    return (nbytes(projected) + nbytes(predecessor_ids) + nbytes(candidate_ids)
            + _distinct_rows(predecessor_ids, vocab) * row_bytes
            + _distinct_rows(candidate_ids, vocab) * rank * successor_codebook.element_size())


def _gathered_unary_bytes(unary, candidate_ids, gathered: bool) -> int:
    if gathered:
        return nbytes(unary)
    rows = candidate_ids.shape[0]
    flat = candidate_ids + torch.arange(rows).unsqueeze(1) * unary.shape[1]
    return int(torch.unique(flat).numel()) * unary.element_size()


def selector_forward(unary, projected, predecessor_codebook, successor_codebook, predecessor_ids, candidate_ids,
                     gathered: bool, scores) -> Minimum:
    """S = U[cand] + T: P, used A and B rows, the ids, U at the candidates, S."""
    total = (_selector_rows(projected, predecessor_codebook, successor_codebook, predecessor_ids, candidate_ids)
             + _gathered_unary_bytes(unary, candidate_ids, gathered) + nbytes(scores))
    return Minimum(total, {"selector_scores_forward_kernel": total})


def selector_backward(grad_scores, projected, predecessor_codebook, successor_codebook, predecessor_ids,
                      candidate_ids, gathered: bool, grads, accumulator_bytes: int) -> Minimum:
    """dU, dP, dA, dB from dS, P, the used A and B rows and the ids. The op's minimum writes
    its outputs whole (dA, dB [V, r] and, for full-vocabulary U, dU [N, V]: dense
    gradients). The kernels write only the rows the ids reach (the rest is the binding's
    zero fill); they hand on P * g [N, r] (accumulator dtype) from the row pass to the
    predecessors' segmented sum."""
    d_unary, d_projected, d_predecessor, d_successor = grads
    vocab, rank = predecessor_codebook.shape
    rows, top_k = candidate_ids.shape
    element = predecessor_codebook.element_size()
    a_rows = _distinct_rows(predecessor_ids, vocab) * rank * element
    b_rows = _distinct_rows(candidate_ids, vocab) * rank * element
    used_unary = 0 if gathered else _gathered_unary_bytes(d_unary, candidate_ids, False)
    pg = rows * rank * accumulator_bytes
    ids = nbytes(predecessor_ids) + nbytes(candidate_ids)
    rows_pass = (ids + nbytes(grad_scores) + nbytes(projected) + a_rows + b_rows + nbytes(d_projected) + pg
                 + used_unary)
    # The segmented sums: sorted ids and their order (int64 each), per entry its terms, the written rows.
    predecessors = 2 * nbytes(predecessor_ids) + pg + a_rows
    successors = (2 * nbytes(candidate_ids) + nbytes(predecessor_ids) + nbytes(grad_scores) + a_rows
                  + nbytes(projected) + b_rows)
    chunk = 64
    carry = lambda entries: 2 * 8 * max(1, -(-entries // chunk))  # noqa: E731  the ids at each chunk's end
    op = (nbytes(grad_scores) + nbytes(projected) + a_rows + b_rows + ids + nbytes(d_projected)
          + nbytes(d_predecessor) + nbytes(d_successor) + (nbytes(d_unary) if not gathered else 0))
    return Minimum(op, {
        "selector_backward_rows_kernel": rows_pass,
        "selector_segment_chunks_kernel[predecessors]": predecessors,
        "selector_segment_carry_kernel[predecessors]": carry(rows),
        "selector_segment_chunks_kernel[successors]": successors,
        "selector_segment_carry_kernel[successors]": carry(rows * top_k),
    })


def topk_partials_bytes(rows: int, vocab: int, top_k: int, slices: int) -> int:
    """The partial lists the first top-k pass hands on: a (key, index) pair of uint32 per entry."""
    return rows * slices * top_k * 8


def candidate_topk(logits, values, ids, slices: int) -> Minimum:
    """values, ids = topk(logits): the logits once, the k values and ids per row."""
    rows, vocab = logits.shape
    top_k = values.shape[-1]
    partials = topk_partials_bytes(rows, vocab, top_k, slices)
    return Minimum(nbytes(logits) + nbytes(values) + nbytes(ids), {
        "topk_partial_kernel": nbytes(logits) + partials,
        "topk_merge_kernel": partials + nbytes(values) + nbytes(ids),
    })


def select_path(logits, projected, predecessor_codebook, successor_codebook, anchor_ids, uniforms, temperature,
                outputs, slices: int) -> Minimum:
    """The walk of one drafted block: the logits once (their top-k), P, the A rows of each
    position's predecessors (the anchor, then the previous position's candidates), the B
    rows of its candidates, the anchors (and uniforms when sampling); path, candidate ids,
    proposal probabilities and edges once. The kernels hand the top-k partial lists on
    and zero one completion counter (int32) per sequence."""
    path, candidate_ids, draft_probs, edges = outputs
    batch, draft, vocab = logits.shape
    rank = predecessor_codebook.shape[1]
    top_k = candidate_ids.shape[-1]
    predecessors = torch.cat([anchor_ids.reshape(batch, 1, 1).expand(batch, 1, top_k), candidate_ids[:, :-1]], 1)
    a_rows = _distinct_rows(predecessors, vocab) * rank * predecessor_codebook.element_size()
    b_rows = _distinct_rows(candidate_ids, vocab) * rank * successor_codebook.element_size()
    sampling = nbytes(uniforms) if temperature > 0 else 0
    written = nbytes(path) + nbytes(candidate_ids) + nbytes(draft_probs) + nbytes(edges)
    shared = nbytes(projected) + a_rows + b_rows + nbytes(anchor_ids) + sampling + written
    partials = topk_partials_bytes(batch * draft, vocab, top_k, slices)
    counters = batch * 4
    return Minimum(nbytes(logits) + shared, {
        "topk_partial_kernel": nbytes(logits) + partials + counters,
        "select_path_kernel": partials + shared + 2 * counters,
    })


def rejection_sample(draft_tokens, target_probs, draft_probs, candidate_ids, uniforms, accepted, bonus,
                     slices: int) -> Minimum:
    """Accept d_t while u_t q_t(d_t) < p_t(d_t), then draw the bonus from row a: the tokens,
    proposals, candidates and uniforms once, p_t(d_t) for each position, the whole target
    row a once (its mass, then the draw); accepted and bonus. The mass pass hands one
    (residual, target) mass pair per vocabulary slice to the draw."""
    batch, draft = draft_tokens.shape
    vocab = target_probs.shape[-1]
    element = target_probs.element_size()
    at_tokens = batch * draft * element
    bonus_rows = batch * vocab * element
    inputs = nbytes(draft_tokens) + nbytes(draft_probs) + nbytes(candidate_ids) + nbytes(uniforms)
    outputs = nbytes(accepted) + nbytes(bonus)
    masses = batch * slices * 2 * 4
    slice_length = min(vocab, 4096)
    return Minimum(inputs + at_tokens + bonus_rows + outputs, {
        "verify_mass_kernel": (nbytes(draft_tokens) + nbytes(draft_probs) + nbytes(candidate_ids)
                               + batch * draft * 4 + at_tokens + bonus_rows + masses + nbytes(accepted)),
        # a, u_D, the slice masses, row a's candidates and proposals, the chosen slice of row a.
        "verify_bonus_kernel": (nbytes(accepted) + batch * 4 + masses + (nbytes(candidate_ids) + nbytes(draft_probs))
                                // draft + batch * slice_length * element + nbytes(bonus)),
    })


@dataclass(frozen=True)
class HeadChunk:
    """One chunk of the draft head's GPU driver: R rows of V logits in the planes' dtype
    (E bytes an entry), S segments a row, K candidates, L losses (L_planes of them with
    planes of P bytes an entry), ``key_words`` int64 words a handed-over candidate takes
    (1 packed, 2 with 64-bit keys), ``logits_bytes`` of logits_dtype."""

    rows: int
    vocab: int
    segments: int
    top_k: int
    target: bool
    labels: bool
    losses: int
    plane_losses: int = 0
    plane_bytes: int = 4
    entry_bytes: int = 4
    logits_bytes: int = 4
    key_words: int = 1

    @property
    def sides(self) -> int:
        return 1 + int(self.target)

    def planes_read(self) -> int:
        """s (and t) read once."""
        return self.rows * self.vocab * self.entry_bytes * self.sides

    def handed_over(self) -> int:
        """What the scan hands the merge: per (row, segment) the normalisers' partials, the
        best keys, and the segment's K best candidates (or all its entries) with a count."""
        per_segment = 16 * self.sides + 16 * int(self.target)
        if self.top_k:
            per_segment += 8 * self.key_words * min(self.top_k, -(-self.vocab // self.segments)) + 4
        else:
            per_segment += 16  # the draft's best
        return self.rows * self.segments * per_segment

    def row_outputs(self) -> int:
        """Per row: ids, z and rounded logits at the top-k, the target's there, the label, its
        logit twice, the two lse, two argmaxes, the ce loss and the fp64 row statistics."""
        k, e, lb = self.top_k, self.entry_bytes, self.logits_bytes
        per_row = k * (8 + e + lb) + 8 + e + lb + 4 + 8 + 40
        per_row += (k * 4 + 4 + 8) if self.target else 0
        return self.rows * per_row


def head_scan(chunk: HeadChunk) -> int:
    """draft_head_scan_kernel: s (and t) read once, the hand-over to the merge written once."""
    return chunk.planes_read() + chunk.handed_over()


def head_merge(chunk: HeadChunk) -> int:
    """draft_head_merge_kernel: the hand-over read, the logits at the top-k ids (both sides)
    and at the label gathered, the labels read, the row outputs written."""
    gathers = chunk.rows * (chunk.top_k * chunk.sides + 1) * chunk.entry_bytes
    return chunk.handed_over() + gathers + 8 * chunk.rows * int(chunk.labels) + chunk.row_outputs()


def head_sweep_forward(chunk: HeadChunk) -> int:
    """draft_head_sweep_kernel in the forward: s (and t) read once, each row's normalisers and
    label read, the segments' six sums (with a target) and the gradient planes written once."""
    sums = chunk.rows * chunk.segments * 48 * int(chunk.target)
    planes = chunk.rows * chunk.plane_losses * chunk.vocab * chunk.plane_bytes
    return chunk.planes_read() + chunk.rows * (40 + 8) + sums + planes


def head_sweep_backward(chunk: HeadChunk, sparse_out: bool = False) -> int:
    """draft_head_sweep_kernel in the backward's recompute: s (and t) read once, the row's
    statistics, label, upstream gradients of the losses, of the top-k (with their ids) and
    of the label read, the combined dL/ds written once in the planes' dtype (and, with
    ``sparse_out``, the K + 1 sparse gradients in the compute dtype)."""
    per_row = 40 + 8 + 4 * chunk.losses + chunk.top_k * (8 + 4) + 4
    per_row += (chunk.top_k + 1) * chunk.entry_bytes * int(sparse_out)
    return chunk.planes_read() + chunk.rows * per_row + chunk.rows * chunk.vocab * chunk.plane_bytes


def head_sparse_add(rows: int, top_k: int, entry_bytes: int, plane_bytes: int) -> int:
    """draft_head_sparse_add_kernel with every one of a row's K + 1 entries in the slice (the
    most it moves): their ids and the label read, the sparse gradients read, each entry of
    the plane read and written."""
    return rows * (8 * top_k + 8 + (top_k + 1) * (entry_bytes + 2 * plane_bytes))


def head_finish(rows: int, segments: int, loss_mask: int, target: bool) -> int:
    """draft_head_finish_kernel: per row the segments' sums it needs (the overlap with a
    target, each soft loss's, jsd's and tv's gradient sums) and the label read; the losses,
    the overlap and the row sums of rkl, jsd and tv written."""
    soft = [bool(loss_mask >> bit & 1) for bit in range(4)]  # kl_div, rkl, jsd, tv
    columns = int(target) + soft[0] + soft[1] + 2 * soft[2] + soft[3]
    losses = bin(loss_mask).count("1") - (loss_mask >> 4 & 1)  # ce is the merge's
    writes = 4 * losses + 4 * int(target) + 8 * (soft[1] + soft[2] + soft[3])
    return rows * (segments * 8 * columns + 8 + writes)


def head_hidden_grad(rows: int, width: int, losses: int, top_k: int, entry_bytes: int, weight_bytes: int,
                     out_bytes: int) -> int:
    """draft_head_hidden_grad_kernel: the kept dL_l/dh rows, the upstream gradients, the K + 1
    W rows the top-k and label logits came from, their ids, logits and gradients read; dh
    written once."""
    per_row = losses * (width * entry_bytes + 4) + (top_k + 1) * width * weight_bytes
    per_row += top_k * (8 + entry_bytes + 4) + 8 + entry_bytes + 4 + width * out_bytes
    return rows * per_row


def head_radix_topk(rows: int, vocab: int, top_k: int, entry_bytes: int) -> int:
    """draft_head_topk_kernel: the raw logits read once, the K ids and their keys written."""
    return rows * (vocab * entry_bytes + 16 * top_k)


def head_shard_pack(rows: int, segments: int, slots: int, target: bool, entry_bytes: int, key_words: int) -> int:
    """draft_head_shard_pack_kernel: the scan's hand-over read (as the merge reads it), the
    logits at this shard's picks and its target best gathered, the pack written."""
    chunk = HeadChunk(rows, max(segments * slots, 1), max(segments, 1), slots, target, False, 0,
                      entry_bytes=entry_bytes, key_words=key_words)
    return chunk.handed_over() + rows * (slots + int(target)) * entry_bytes + rows * (2 * slots + 4) * 8


def head_shard_merge(rows: int, world: int, slots: int, top_k: int, target: bool, labels: bool,
                     entry_bytes: int) -> int:
    """draft_head_shard_merge_kernel: every rank's pack read, the logits this rank owns at the
    merged ids and the label gathered, the per-row outputs and the shares' gathered columns
    written."""
    gathered = world * rows * (2 * slots + 4) * 8
    gathers = rows * (top_k * (1 + int(target)) + 1) * entry_bytes
    outputs = rows * (top_k * 8 + 8 + 4 + 4 + 8 + 8 + 40 + (2 * top_k + 1) * 8)
    return gathered + gathers + 8 * rows * int(labels) + outputs


def head_shard_shares(rows: int, segments: int, top_k: int) -> int:
    """draft_head_shard_shares_kernel: the segments' sums read, the six shares written."""
    return rows * (segments * 48 + 48)


def head_shard_final(rows: int, losses: int, top_k: int, entry_bytes: int, logits_bytes: int, target: bool) -> int:
    """draft_head_shard_final_kernel: the summed shares and the label read; losses, overlap,
    the top-k's and label's logits (twice: E and rounded), the target's at the top-k and the
    row sums written."""
    shares = (6 + 2 * top_k + 1) * 8
    writes = 4 * losses + 4 * int(target) + top_k * (entry_bytes + logits_bytes + 4) + entry_bytes + logits_bytes + 24
    return rows * (shares + 8 + writes + 8)
