"""What the end-to-end trainer runs train on, made by the test (nothing is downloaded).

:func:`verifier`: a tiny random Qwen3 verifier with a word-level tokenizer and a chat
template, written with ``save_pretrained`` (speculators reads its config, embeddings and
lm_head; NeMo loads it as the online target and tokenizes with it).
:func:`speculators_data`: speculators' offline training data in its own layout: a
``datasets`` dataset of input_ids / loss_mask / seq_len saved to disk, and per-sample
hidden states ``hidden_states/hs_{i}.safetensors`` ({"hidden_states": [seq, layers + 1,
H], "token_ids": [seq]}: the verifier's layers ``TARGET_LAYER_IDS`` and its last, normed,
hidden state), computed by the verifier itself.
:func:`nemo_data`: a small JSONL chat dataset for NeMo's online recipe.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

HIDDEN, VERIFIER_LAYERS, VOCAB = 64, 4, 128
TARGET_LAYER_IDS = [1, 2]
SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "<mask>", "user", "assistant", "system"]
MASK_TOKEN = SPECIALS.index("<mask>")
WORDS = [f"w{i}" for i in range(VOCAB - len(SPECIALS))]
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|im_start|> {{ message['role'] }} "
    "{%- if message['role'] == 'assistant' %} {% generation %}{{ message['content'] }} <|im_end|>{% endgeneration %} "
    "{%- else %} {{ message['content'] }} <|im_end|> {% endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|> assistant {% endif -%}"
)


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIALS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                        eos_token="<|im_end|>", bos_token=None)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def verifier(path: Path, seed: int = 0) -> Path:
    """Write the tiny Qwen3 verifier and its tokenizer to ``path``; returns ``path``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                         num_hidden_layers=VERIFIER_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
                         pad_token_id=0, eos_token_id=SPECIALS.index("<|im_end|>"), bos_token_id=None)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # peaked next-token distributions, as a trained model's are
        model.lm_head.weight.normal_(std=0.5)
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path


def _conversations(count: int, seed: int) -> list[list[dict]]:
    generator = torch.Generator().manual_seed(seed)

    def words(length: int) -> str:
        return " ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (length,), generator=generator))

    return [[{"role": "user", "content": words(6 + index % 3)},
             {"role": "assistant", "content": words(14 + 3 * (index % 4))}] for index in range(count)]


def speculators_data(path: Path, verifier_path: Path, count: int = 8, seed: int = 1) -> Path:
    """Write ``count`` samples of speculators' offline training data to ``path``."""
    from datasets import Dataset
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    tokenizer = _tokenizer()
    model = AutoModelForCausalLM.from_pretrained(verifier_path, dtype=torch.float32).eval()
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    (path / "hidden_states").mkdir(parents=True)
    for index, messages in enumerate(_conversations(count, seed)):
        encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
        ids = torch.tensor(encoded["input_ids"])
        with torch.no_grad():
            states = model(ids[None], output_hidden_states=True).hidden_states
        layers = [states[layer + 1][0] for layer in TARGET_LAYER_IDS] + [states[-1][0]]
        save_file({"hidden_states": torch.stack(layers, dim=1).contiguous(), "token_ids": ids},
                  str(path / "hidden_states" / f"hs_{index}.safetensors"))
        rows["input_ids"].append(ids.tolist())
        rows["loss_mask"].append([bool(m) for m in encoded["assistant_masks"]])
        rows["seq_len"].append(len(ids))
    Dataset.from_dict(rows).with_format("torch").save_to_disk(str(path))
    return path


def nemo_data(path: Path, count: int = 8, seed: int = 2) -> Path:
    """Write ``count`` chat conversations as JSONL ({"messages": [...]}) to ``path``."""
    path.write_text("".join(json.dumps({"messages": messages}) + "\n" for messages in _conversations(count, seed)))
    return path
