"""Speculative decoding with NeMo Automodel's DFlash 2 ``spec_generate`` on the fused kernels.

Shows: ``dk.patch_nemo()`` installing ours in NeMo's ``draft_qwen3_dflash2`` module, so
that a ``Qwen3DFlash2DraftModel`` built afterwards is built from our conv and selector,
and ``spec_generate`` runs our fused walk (``CandidateSelector.walk``) and our
rejection sampling (``dflash2_rejection_sample``). It then generates a few tokens
greedily and sampled, and checks that the greedy output is exactly the target's own
greedy decoding (speculative decoding is lossless; exit status 1 if not).

Target and draft are tiny and random (``examples/tiny_models.py``: a 4-layer
``Qwen3ForCausalLM``, a 2-layer draft, V = 512; nothing is downloaded), so few drafted
tokens are accepted. Runs in seconds on a CPU, unchanged on a GPU::

    python examples/nemo_serve_step.py
"""

from __future__ import annotations

import sys

import torch
from tiny_models import VOCAB, as_if_trained, nemo_draft, qwen3_target

import dflash2_kernels as dk

PROMPT, NEW_TOKENS = 8, 12


@torch.no_grad()
def target_greedy(target, input_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The target's own greedy decoding, one full forward per token: [1, P + new_tokens]."""
    for _ in range(new_tokens):
        next_id = target(input_ids).logits[:, -1].argmax(-1, keepdim=True)
        input_ids = torch.cat([input_ids, next_id], dim=1)
    return input_ids


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(dk.patch_nemo())
    target = qwen3_target(seed=0).to(device)
    draft = as_if_trained(nemo_draft(seed=1), seed=2).to(device)
    print(f"draft built from {type(draft.candidate_selector).__module__}.{type(draft.candidate_selector).__name__}")

    prompt = torch.randint(0, VOCAB - 1, (1, PROMPT), generator=torch.Generator().manual_seed(0)).to(device)
    greedy = draft.spec_generate(target, prompt, NEW_TOKENS, stop_token_ids=None, temperature=0.0)
    print(f"greedy : {greedy[0, PROMPT:].tolist()}")
    torch.manual_seed(0)  # spec_generate samples the first token from the global generator
    sampled = draft.spec_generate(target, prompt, NEW_TOKENS, stop_token_ids=None, temperature=1.0)
    print(f"sampled: {sampled[0, PROMPT:].tolist()}")

    expected = target_greedy(target, prompt, greedy.shape[1] - PROMPT)
    lossless = torch.equal(greedy, expected)
    print(f"greedy output equals the target's own greedy decoding: {lossless}")
    if not lossless:
        print(f"target's own: {expected[0, PROMPT:].tolist()}")
        sys.exit(1)


if __name__ == "__main__":
    main()
