"""Ahead-of-time compilation of the launchers' Triton kernels for GPUs that are not here.

Run as ``python -m tests.triton_aot ARCH...`` (compute capabilities as numbers: 80 90 120)
in a process without ``TRITON_INTERPRET``: under the interpreter even triton.language's
own helpers (``tl.zeros``) are interpreter objects and cannot be compiled. It reads a
JSON list of conv and draft head row configurations on stdin and prints, per
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
    return triton.compile(source, target=target, options={"num_warps": launch.num_warps})


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
    """The forward and backward launches the conv launchers plan for one configuration."""
    from dflash2_kernels.conv import launch

    x_dtype, delta_dtype, base_dtype = (getattr(torch, name) for name in dtypes)
    x = torch.empty(rows, hidden, dtype=x_dtype, device="meta")
    delta = torch.empty(rows, 2, taps, hidden // group_size, dtype=delta_dtype, device="meta")[:, 1]
    base_x = torch.empty(taps, hidden, dtype=base_dtype, device="meta").to(x_dtype)
    out_dtype = torch.promote_types(x_dtype, delta_dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device="meta")
    forward = launch.plan_conv_forward(x, delta, base_x, out, block_size=8)
    acc = launch.accumulator_dtype(out, x, delta, base_x)
    backward, *_ = launch.plan_conv_backward(out, x, delta, base_x, 8, acc)
    return {"forward": forward, "backward": backward}


def head_row_plans(dtype: str, loss_mask: int, target: bool, labels: bool, softcap: bool, grads: bool,
                   rows: int = 512, vocab: int = 248_320) -> dict:
    """The draft head's row launches for one configuration: a chunk of ``rows`` rows of the
    Qwen3.8-27B vocabulary by default. One process: forward, backward; vocab parallel
    (a shard of it): the statistics pass, the shares pass (with the planes where no loss
    needs a merged sum), the planes pass and the backward's recompute."""
    from dflash2_kernels.head import row_launch as rl

    plane_dtype = getattr(torch, dtype)
    losses_n = rl.loss_count(loss_mask)

    def plane(*shape, dtype=plane_dtype):
        return torch.empty(*shape, dtype=dtype, device="meta")

    logits = plane(rows, vocab)
    target_logits = plane(rows, vocab) if target else None
    label_ids = plane(rows, dtype=torch.int64) if labels else None
    cap = 30.0 if softcap else 0.0
    losses = plane(losses_n, rows)
    loss_grads = plane(losses_n, rows, vocab) if grads else None
    common = (logits, target_logits, label_ids, loss_mask, 1.0, cap)
    local_labels = plane(rows, dtype=torch.int64)
    shard = (logits, target_logits, local_labels, loss_mask, 1.0, cap)
    row_stats = plane(rows, 7, dtype=torch.float64)
    global_sums = loss_mask & 0b01110
    return {
        "forward": rl.plan_head_rows(rl.FORWARD, *common, losses=losses, stats=plane(rows, 3),
                                     loss_grads=loss_grads),
        "backward": rl.plan_head_rows(rl.BACKWARD, *common, grad_losses=losses),
        "shard_stats": rl.plan_head_rows(rl.SHARD_STATS, logits, target_logits, None, 0, 1.0, cap,
                                         shard_out=plane(rows, 2, dtype=torch.float64)),
        "shard_shares": rl.plan_head_rows(rl.SHARD_ROWS, *shard, shard_out=plane(rows, 6, dtype=torch.float64),
                                          row_stats=row_stats, loss_grads=None if global_sums else loss_grads,
                                          shares=True),
        "shard_planes": rl.plan_head_rows(rl.SHARD_ROWS, *shard, row_stats=row_stats, loss_grads=loss_grads),
        "shard_backward": rl.plan_head_rows(rl.SHARD_ROWS, *shard, row_stats=row_stats, grad_losses=losses,
                                            transform=True),
    }


def topk_plans(dtype: str, rows: int = 512, vocab: int = 248_320, top_k: int = 16) -> dict:
    """The draft head's top-k launch over values of ``dtype`` (the logits rounded)."""
    from dflash2_kernels.head.topk_launch import plan_row_topk

    values = torch.empty(rows, vocab, dtype=getattr(torch, dtype), device="meta")
    ids = torch.empty(rows, top_k, dtype=torch.int64, device="meta")
    return {"topk": plan_row_topk(values, top_k, ids, torch.empty_like(ids))}


def plans_of(config) -> dict:
    """A conv configuration is a list (conv_plans' arguments); a draft head row
    configuration a dict {"head_rows": head_row_plans' keyword arguments}, a top-k one
    {"head_topk": topk_plans' keyword arguments}."""
    if isinstance(config, dict) and "head_topk" in config:
        return topk_plans(**config["head_topk"])
    if isinstance(config, dict):
        return head_row_plans(**config["head_rows"])
    return conv_plans(*config)


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
        for key, kernels in plans.items():
            by_config[key] = {}
            for kernel, plan in kernels.items():
                try:
                    by_config[key][kernel] = resource_usage(compile_launch(plan, target), plan.num_warps)
                except Exception as error:  # reported per configuration by the test
                    by_config[key][kernel] = {"error": f"{type(error).__name__}: {error}"}
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
