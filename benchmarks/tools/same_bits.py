"""The selector ops' bits under two builds: same_bits.py save FILE.pt | compare OLD.pt NEW.pt."""

# 44 results: per shape the backward's four gradients (gathered and full unary) and the
# forward in row and candidate order (DFLASH2_SELECTOR_ORDER). The shapes cover fp32,
# fp64, bf16 and fp16, r from 8 to 256 with and without a tail past the 64-wide chunks,
# bf16 codebooks under fp32 P, and 65,536 rows. Save once under each build (switch with
# DFLASH2_EXTENSION_PATH=<build>/_C.so, and again with DFLASH2_DISABLE_AVX512=1 on an
# AVX-512 machine), then compare: a kernel change that claims "the same bits" must
# print "0 differ".

import os
import sys

import torch

SHAPES = [  # N, V, r, k, dtype, P's dtype (None: the codebooks')
    (4096, 32000, 64, 16, torch.float32, None), (777, 50, 24, 5, torch.float32, None),
    (300, 1000, 16, 4, torch.float64, None), (513, 4000, 32, 8, torch.bfloat16, None),
    (65536, 64, 8, 4, torch.float32, None), (513, 4000, 128, 8, torch.bfloat16, None),
    (300, 1000, 80, 5, torch.float32, None), (300, 1000, 100, 5, torch.bfloat16, None),
    (200, 500, 128, 6, torch.bfloat16, torch.float32), (65536, 64, 80, 4, torch.float32, None),
    (100, 3000, 256, 16, torch.float16, None),
]


def save(path: str) -> None:
    import dflash2_kernels  # noqa: F401  (registers torch.ops.dflash2)

    torch.manual_seed(0)
    out = {}
    for n, v, r, k, dtype, p_dtype in SHAPES:
        a, b = torch.randn(v, r, dtype=dtype), torch.randn(v, r, dtype=dtype)
        p = torch.randn(n, r, dtype=p_dtype or dtype)
        grad, unary = torch.randn(n, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
        pred, cand = torch.randint(0, v, (n,)), torch.randint(0, v, (n, k))
        key = (n, v, r, k, str(dtype), str(p_dtype))
        for gathered, width in ((True, k), (False, v)):
            grads = torch.ops.dflash2.selector_scores_backward(grad, p, a, b, pred, cand, gathered, width, dtype)
            out[key + (gathered,)] = [g.clone() for g in grads]
        for order in ("row", "candidate"):
            os.environ["DFLASH2_SELECTOR_ORDER"] = order
            out[key + (order,)] = torch.ops.dflash2.selector_scores(unary, p, a, b, pred, cand, True, dtype)
        del os.environ["DFLASH2_SELECTOR_ORDER"]
    torch.save(out, path)
    print(f"saved {len(out)} results to {path}")


def compare(old_path: str, new_path: str) -> int:
    old, new = torch.load(old_path), torch.load(new_path)
    differ = 0
    for key in old:
        xs, ys = old[key], new[key]
        for i, (x, y) in enumerate(zip(xs if isinstance(xs, list) else [xs], ys if isinstance(ys, list) else [ys])):
            if not torch.equal(x, y):
                differ += 1
                print("DIFF", key, i, (x.double() - y.double()).abs().max().item())
    print(f"compared {len(old)} keys; {differ} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "save":
        save(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)
