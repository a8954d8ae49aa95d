"""Ahead-of-time compilation of the launchers' Triton kernels for GPUs that are not here.

Run as ``python -m tests.triton_aot ARCH...`` (compute capabilities as numbers: 80 90 120)
in a process without ``TRITON_INTERPRET``: under the interpreter even triton.language's
own helpers (``tl.zeros``) are interpreter objects and cannot be compiled. It reads a
JSON list of conv and draft head configurations on stdin and prints, per
architecture, configuration and kernel, the resource usage (or the compile error).
Signatures and divisibility hints come from Triton's own run-time specializer, so what
compiles here is what the launcher would JIT on the device.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource

SM90 = GPUTarget("cuda", 90, 32)
_CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compile_launch(launch, target: GPUTarget = SM90):
    """Compile a ``KernelLaunch`` for ``target``; returns Triton's compiled kernel."""
    fn = launch.kernel
    signature, constexprs, attrs = {}, dict(launch.constexprs), {}
    for index, name in enumerate(fn.arg_names):
        if name in launch.constexprs:
            signature[name] = "constexpr"
            continue
        declared = fn.params[index].annotation_type
        if declared:  # a typed scalar (``x: tl.float64``): the JIT passes it as declared
            signature[name] = declared
            continue
        kind, hint = native_specialize_impl(BaseBackend, launch.args[name], False, True, True)
        if kind == "constexpr":  # Triton specializes ints equal to 1
            signature[name] = "constexpr"
            constexprs[name] = hint
            continue
        signature[name] = kind
        if hint == "D":
            attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(source, target=target, options={"num_warps": launch.num_warps,
                                                          "num_stages": launch.num_stages})


def resource_usage(compiled, num_warps: int) -> dict[str, int]:
    """Registers, local (spill) bytes, stack, shared memory (static, and the dynamic bytes
    Triton's launcher asks for) and threads of a compiled kernel's block."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        dump = subprocess.run(
            [_CUOBJDUMP, "--dump-resource-usage", cubin.name], capture_output=True, text=True, check=True
        ).stdout
    fields = dict(re.findall(r"(REG|LOCAL|STACK|SHARED):(\d+)", dump))
    return {"registers": int(fields["REG"]), "local": int(fields["LOCAL"]),
            "stack": int(fields["STACK"]), "shared": int(fields["SHARED"]),
            "dynamic_shared": int(compiled.metadata.shared), "threads": 32 * num_warps}


def conv_plans(hidden: int, group_size: int, taps: int, dtypes: list[str], rows: int = 4096) -> dict:
    """The forward, backward and dbase launches the conv launchers plan for one configuration."""
    from dflash2_kernels.conv import launch

    x_dtype, delta_dtype, base_dtype = (getattr(torch, name) for name in dtypes)
    x = torch.empty(rows, hidden, dtype=x_dtype, device="meta")
    delta = torch.empty(rows, 2, taps, hidden // group_size, dtype=delta_dtype, device="meta")[:, 1]
    base = torch.empty(taps, hidden, dtype=base_dtype, device="meta")
    out_dtype = torch.promote_types(x_dtype, delta_dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device="meta")
    forward = launch.plan_conv_forward(x, delta, base, out, block_size=8)
    acc = launch.accumulator_dtype(out, x, delta, base)
    backward, _, _, partials = launch.plan_conv_backward(out, x, delta, base, 8, acc)
    dbase = launch.plan_conv_dbase(partials, torch.empty(base.shape, dtype=base_dtype, device="meta"))
    return {"forward": forward, "backward": backward, "dbase": dbase}


def head_plans(weight: str, logits: str, loss_mask: int, target: bool, labels: bool, softcap: bool, top_k: int,
               rows: int = 512, vocab: int = 248_320, width: int = 5120) -> dict:
    """Every launch of the draft head's GPU drivers (gpu_driver.py, shard_gpu.py) for one
    configuration: a chunk of ``rows`` rows of the Qwen3.8-27B vocabulary by default, a
    weight of dtype ``weight`` (its planes in the compute dtype, its gradient planes in
    its own dtype when 16-bit), logits rounded to ``logits`` for the ranking."""
    from dflash2_kernels.head import gpu_launch as gl
    from dflash2_kernels.head.gemm import compute_dtype
    from dflash2_kernels.head.tiles import ROW_STATS, plane_dtype

    weight_dtype, logits_dtype = getattr(torch, weight), getattr(torch, logits)
    dtype, planes_dtype = compute_dtype(weight_dtype), plane_dtype(weight_dtype)
    losses = bin(loss_mask).count("1")
    cap = 30.0 if softcap else 0.0
    f64, i64 = torch.float64, torch.int64

    def meta(*shape, dtype=dtype):
        return torch.empty(*shape, dtype=dtype, device="meta")

    s = meta(rows, vocab)
    t = meta(rows, vocab) if target else None
    label_ids = meta(rows, dtype=i64)
    n_segments = gl.segments(vocab, dtype, softcap)
    mode = 0 if top_k == 0 else (1 if top_k <= gl.MAX_CANDIDATE_K else 2)
    width_k = max(top_k, 1)
    cand = [meta(rows, n_segments, gl.candidate_cap(width_k), dtype=i64),
            meta(rows, n_segments, gl.candidate_cap(width_k), dtype=i64)
            if gl.candidate_ids_needed(dtype, logits_dtype) else None, meta(rows, n_segments, dtype=torch.int32)]
    partials, best = meta(rows, n_segments, 4, dtype=f64), meta(rows, n_segments, 4, dtype=i64)
    outputs = {
        "losses": meta(losses, rows, dtype=torch.float32), "topk_ids": meta(rows, top_k, dtype=i64),
        "topk_z": meta(rows, top_k), "topk_logits": meta(rows, top_k, dtype=logits_dtype),
        "at_topk": meta(rows, top_k, dtype=torch.float32), "label_ids": label_ids, "label_z": meta(rows),
        "label_logit": meta(rows, dtype=logits_dtype), "draft_lse": meta(rows, dtype=torch.float32),
        "target_lse": meta(rows, dtype=torch.float32), "draft_argmax": meta(rows, dtype=i64),
        "target_argmax": meta(rows, dtype=i64), "overlap": meta(rows, dtype=torch.float32),
        "row_stats": meta(rows, ROW_STATS, dtype=f64), "shares": meta(rows, gl.shares_width(top_k), dtype=f64),
    }
    sums = meta(rows, n_segments, gl.SUMS_COLUMNS, dtype=f64)
    planes = meta(rows, losses, vocab, dtype=planes_dtype)
    grad_plane = meta(rows, vocab, dtype=planes_dtype)
    grad_losses = meta(losses, rows, dtype=torch.float32)
    grad_topk = meta(rows, top_k, dtype=torch.float32)
    grad_label = meta(rows, dtype=torch.float32)
    sparse = meta(rows, top_k + 1)
    labels_in = meta(rows, dtype=i64) if labels else None
    given = meta(rows, top_k, dtype=i64) if mode == 2 else None
    scalars = (1.0, cap)
    weight_rows = meta(vocab, width, dtype=weight_dtype)
    send = meta(rows, gl.send_width(width_k), dtype=i64)
    plans = {
        "scan": gl.plan_scan(s, t, partials, best, *cand, max(min(top_k, gl.MAX_CANDIDATE_K), 1), *scalars,
                             logits_dtype, mode == 1),
        "merge": gl.plan_merge(s, t, partials, best, *cand, given, labels_in, outputs, 0, top_k, *scalars,
                               logits_dtype, mode, 0 if loss_mask & gl.CE else -1),
        "sweep": gl.plan_sweep(s, t, outputs["row_stats"], label_ids, sums if target else None, planes, 0, loss_mask,
                               *scalars, grads=1 if loss_mask & (gl.KL | gl.CE) else 0,
                               plane_mask=loss_mask & (gl.KL | gl.CE)),
        "sweep_row_sums": gl.plan_sweep(s, t, outputs["row_stats"], label_ids, None, planes, 0, loss_mask, *scalars,
                                        grads=1, plane_mask=loss_mask & (gl.RKL | gl.JSD | gl.TV)),
        "sweep_backward": gl.plan_sweep(s, t, outputs["row_stats"], label_ids, None, grad_plane, 0, loss_mask,
                                        *scalars, grads=2, grad_losses=grad_losses, topk_ids=outputs["topk_ids"],
                                        grad_topk=grad_topk, grad_label=grad_label),
        "sweep_backward_sparse": gl.plan_sweep(s, t, outputs["row_stats"], label_ids, None, grad_plane, 0, loss_mask,
                                               *scalars, grads=2, grad_losses=grad_losses,
                                               topk_ids=outputs["topk_ids"], grad_topk=grad_topk,
                                               grad_label=grad_label, sparse=sparse),
        "sparse_add": gl.plan_sparse_add(grad_plane, sparse, outputs["topk_ids"], label_ids, 7, top_k > 0, True),
        "sparse_hidden_grad": gl.plan_hidden_grad(meta(rows, width), None, None, weight_rows, outputs["topk_ids"],
                                                  sparse[:, :top_k], sparse[:, :top_k], label_ids, sparse[:, top_k],
                                                  sparse[:, top_k], *scalars, sloped=False, accumulate=True),
        "finish": gl.plan_finish(sums, label_ids, outputs["losses"], outputs["overlap"], outputs["row_stats"], 0,
                                 rows, loss_mask, target),
        "hidden_grad": gl.plan_hidden_grad(meta(rows, width, dtype=weight_dtype), meta(rows, losses, width),
                                           grad_losses, weight_rows, outputs["topk_ids"], outputs["topk_z"],
                                           grad_topk, label_ids, outputs["label_z"], grad_label, *scalars),
        "shard_pack": gl.plan_shard_pack(s, t, partials, best, *cand, given, send, 0, width_k,
                                         min(width_k, vocab), *scalars, logits_dtype, 1 if mode != 2 else 2),
        "shard_merge": gl.plan_shard_merge(meta(2, rows, gl.send_width(width_k), dtype=i64), s, t, labels_in, given,
                                           outputs, 0, 0, 2 * vocab, top_k, *scalars, logits_dtype,
                                           1 if mode != 2 else 2),
        "shard_shares": gl.plan_shard_shares(sums, outputs["shares"], 0, rows, top_k),
        "shard_final": gl.plan_shard_final(outputs, 0, rows, top_k, loss_mask, target, dtype, logits_dtype),
        "shard_hidden_grad": gl.plan_hidden_grad(meta(rows, width), meta(rows, losses, width), grad_losses,
                                                 weight_rows, outputs["topk_ids"], outputs["topk_z"], grad_topk,
                                                 label_ids, outputs["label_z"], grad_label, *scalars, vocab_start=7,
                                                 shard=True),
    }
    if not loss_mask & (gl.RKL | gl.JSD | gl.TV):
        del plans["sweep_row_sums"]
    if mode == 2:
        ids = meta(rows, top_k, dtype=i64)
        plans["radix_topk"] = gl.plan_radix_topk(s, top_k, ids, torch.empty_like(ids), *scalars, logits_dtype)
    return plans


def plans_of(config) -> dict:
    """A conv configuration is a list (conv_plans' arguments); a draft head configuration a
    dict {"head": head_plans' keyword arguments} (with "kernels": only those). A conv list's
    fifth item or a head dict's "tuning" is a member index: every kernel in its space's member of that index (spaces
    with fewer members keep their default), else the defaults."""
    from dflash2_kernels.tuning import SPACES, TUNER

    index = config.get("tuning", 0) if isinstance(config, dict) else (config[4] if len(config) > 4 else 0)
    with TUNER.forced({name: space.configs[index] for name, space in SPACES.items() if len(space.configs) > index}):
        if not isinstance(config, dict):
            return conv_plans(*config[:4])
        plans = head_plans(**config["head"])
    only = config.get("kernels")  # a head configuration's kernels of interest (default: all)
    return {kernel: plan for kernel, plan in plans.items() if only is None or kernel in only}


def _compile_key(launch) -> str:
    """What decides a launch's compiled kernel: the kernel, its constexprs, warps, stages,
    and its arguments' types and divisibility (as Triton's specializer sees them)."""
    specialized = [native_specialize_impl(BaseBackend, value, False, True, True)
                   for value in launch.args.values()]
    return repr((launch.kernel.fn.__qualname__, sorted(launch.constexprs.items(), key=lambda kv: kv[0]),
                 launch.num_warps, launch.num_stages, specialized))


def main() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("tests.triton_aot must run without TRITON_INTERPRET=1")
    archs = [int(arch) for arch in sys.argv[1:]] or [90]
    configs = json.load(sys.stdin)
    plans = {json.dumps(config): plans_of(config) for config in configs}
    results = {}
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)
        results[str(arch)] = by_config = {}
        compiled = {}  # a configuration's member beside another's default is often the same kernel
        for key, kernels in plans.items():
            by_config[key] = {}
            for kernel, plan in kernels.items():
                same = _compile_key(plan)
                if same not in compiled:
                    try:
                        compiled[same] = resource_usage(compile_launch(plan, target), plan.num_warps)
                    except Exception as error:  # reported per configuration by the test
                        compiled[same] = {"error": f"{type(error).__name__}: {error}"}
                by_config[key][kernel] = compiled[same]
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
