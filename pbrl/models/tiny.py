"""The packaged ``tiny-random`` model: a tiny random Llama with a byte-level BPE tokenizer, built locally in a
fraction of a second (no download), for smoke runs, the tiny configs and the tests."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = "the a agent answer question reward model policy good bad says helps user is not and of to in".split()


def build_tiny_model(path: str | Path, seed: int = 0) -> Path:
    """Build and save a tiny random ``LlamaForCausalLM`` (about 95k parameters) and its tokenizer.

    The tokenizer is a byte-level BPE (vocab 320) trained on a seeded word corpus, with a ChatML chat
    template, pad ``<|pad|>`` and EOS ``<|im_end|>``. Same ``seed`` gives the same files' contents.

    Returns:
        The folder, loadable with ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained``.
    """

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) + "." for _ in range(400)]
    tk = Tokenizer(models.BPE(unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<|pad|>", eos_token="<|im_end|>", bos_token="<|endoftext|>"
    )
    tok.chat_template = CHAT_TEMPLATE
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,  # HumanEval prompts are 500-700 of its tokens
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
