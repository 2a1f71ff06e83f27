"""A tiny random Qwen2 target with a tokenizer of its own (byte-level BPE, ChatML template):
another target than SmolLM2 in milliseconds, for the paths that take any target (training a
drafter or a next-token head for it). Its embedding has rows past the tokenizer, as Qwen's
has, so a drafter's mask token is the first of them."""

from __future__ import annotations

from pathlib import Path

import torch

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = 320  # the tokenizer's; the embedding has VOCAB rows
VOCAB = 336
TEXT = ["def add(a, b):\n    return a + b\n", "Write a function that counts words.", "SELECT id FROM users;",
        "Explain what an index is.", "The quick brown fox jumps over the lazy dog."] * 20


def make_tiny_qwen2(folder: Path, seed: int = 0) -> Path:
    """A tiny Qwen2ForCausalLM (hidden 32, 4 layers) and its tokenizer saved in `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=TOKENS, special_tokens=SPECIALS,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHATML
    torch.manual_seed(seed)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=eos, bos_token_id=None, pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
                      initializer_range=0.5)
    model = Qwen2ForCausalLM(cfg).float().eval()
    model.generation_config.eos_token_id = eos
    folder = Path(folder)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
