"""Tiny random-weight models and character-level tokenizers, built locally.

The quick start and the tests need a real causal LM and a real tokenizer
without downloading anything. This module writes an ordinary Hugging Face
model directory (Qwen3 architecture, random weights, a character-level
`tokenizers` tokenizer with a Qwen-style chat template), which every other
part of Relax then loads through the same code as a real checkpoint:
`AutoModelForCausalLM.from_pretrained(dir)` / `AutoTokenizer.from_pretrained(dir)`.
"""

from __future__ import annotations

import string
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Characters the chat template itself needs ("user", "assistant", "system", newlines).
TEMPLATE_CHARS = "\n :" + "".join(sorted(set("systemuserassistant")))
DEFAULT_ALPHABET = string.ascii_lowercase + string.digits + " +-=?.,"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _vocabulary(alphabet: str) -> dict[str, int]:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in dict.fromkeys(TEMPLATE_CHARS + alphabet):  # ordered, unique
        vocab.setdefault(ch, len(vocab))
    return vocab


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET):
    """A fast tokenizer with one token per character plus Qwen's special tokens.

    A BPE model with no merges splits any string into single characters, so
    every character of `alphabet` (and of the chat template) is one token.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = _vocabulary(alphabet)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    backend.decoder = decoders.Fuse()  # join characters back without separators
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_qwen3_config(
    vocab_size: int,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
):
    """A Qwen3 config small enough to train on two CPU cores."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        intermediate_size=intermediate_size or 2 * hidden_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )


# `model.architecture` of a tiny recipe -> the function that builds its config (the schema's Literal lists these).
CONFIG_BUILDERS = {"qwen3": tiny_qwen3_config}


def materialize_tiny_model(
    out_dir: str | Path,
    *,
    architecture: str = "qwen3",
    seed: int = 0,
    alphabet: str = DEFAULT_ALPHABET,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
) -> Path:
    """Write a random-weight model of `architecture` and its tokenizer as an HF directory.

    The same seed and sizes always give the same weights, so every process of
    a run (trainer ranks, engines) that materialises the model agrees.

    Returns:
        The directory, loadable with `from_pretrained`.
    """
    if architecture not in CONFIG_BUILDERS:
        raise ValueError(f"no tiny model of architecture {architecture!r} (known: {', '.join(CONFIG_BUILDERS)})")
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    tokenizer = build_char_tokenizer(alphabet)
    config = CONFIG_BUILDERS[architecture](
        len(tokenizer),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
