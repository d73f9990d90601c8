"""Tiny random-init Hugging Face models of real architectures, with a locally trained BPE tokenizer.

Why: polyrl computes logits itself (``polyrl.model.head_logits`` on the base model's hidden states,
in the sampler and in the trainer alike) and runs its own KV-cache decode loop, so every architecture
quirk (GPT-2's ``transformer`` base model and absolute positions, Gemma's soft-capped logits and
sliding windows, fused QKV of Phi-3, tied embeddings, ...) is a chance for the two paths to disagree
with each other or with ``transformers``. The architecture test matrix (``tests/test_architectures.py``)
builds one tiny model per architecture with this module and runs it through generation, training,
checkpointing and export. Nothing is downloaded: the tokenizer is a byte-level BPE trained with the
``tokenizers`` library on a small built-in corpus (arithmetic strings and some English), wrapped as a
``PreTrainedTokenizerFast`` with bos/eos/pad tokens and a simple Jinja chat template, and saved with
``save_pretrained`` next to the model, so ``AutoTokenizer``/``AutoModelForCausalLM.from_pretrained``
load the directory like any hub model.

``ARCHITECTURES`` maps an architecture name to its config class name and the keyword arguments
that make it tiny (hidden 64, 2 layers); only those the installed transformers provides are listed.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

BOS, EOS, PAD, END_OF_TURN = "<bos>", "<eos>", "<pad>", "<|end|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, END_OF_TURN)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
ENGLISH = (
    "The quick brown fox jumps over the lazy dog. What is the sum of two numbers? "
    "Add the numbers and write the answer. The answer is a number. Think step by step, then answer. "
    "A model learns from rewards: good answers are reinforced, bad ones are not. "
    "Question: how much is seven plus five? Answer: twelve. Hello world, this is a tiny test corpus."
)

_COMMON = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=96, max_position_embeddings=256)
_GQA = dict(_COMMON, num_attention_heads=4, num_key_value_heads=2)
# arch -> (config class name in transformers, tiny keyword arguments)
_TABLE: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", _GQA),
    "qwen2": ("Qwen2Config", _GQA),
    "qwen3": ("Qwen3Config", dict(_GQA, head_dim=16)),
    "mistral": ("MistralConfig", dict(_GQA, sliding_window=None)),
    # Gemma 2: soft-capped final logits and attention, alternating sliding-window layers (window 8 < prompt+completion)
    "gemma2": ("Gemma2Config", dict(_GQA, head_dim=16, sliding_window=8, final_logit_softcapping=30.0,
                                    attn_logit_softcapping=50.0, query_pre_attn_scalar=16)),
    "gemma3_text": ("Gemma3TextConfig", dict(_GQA, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                             layer_types=["sliding_attention", "full_attention"])),
    "phi3": ("Phi3Config", dict(_GQA)),
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_inner=96, n_positions=256)),
    "olmo2": ("Olmo2Config", _GQA),
    # hybrids whose cache holds convolution / recurrent states beside keys and values (finished rows stay in a batch)
    "lfm2": ("Lfm2Config", dict(_GQA, layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False)),
    "qwen3_5": ("Qwen3_5TextConfig", dict(_GQA, head_dim=16, layer_types=["linear_attention", "full_attention"],
                                          linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                                          linear_num_value_heads=4)),
}


def _available() -> dict[str, tuple[type, dict]]:
    import transformers

    return {arch: (getattr(transformers, cls), kw) for arch, (cls, kw) in _TABLE.items() if hasattr(transformers, cls)}


ARCHITECTURES: dict[str, tuple[type, dict]] = _available()


def corpus(size: int = 400, seed: int = 0) -> list[str]:
    """Arithmetic strings (``"48+95=143"``, several operators) and English sentences, deterministic in ``seed``."""
    rng = random.Random(seed)
    lines = []
    for _ in range(size):
        a, b = rng.randrange(100), rng.randrange(100)
        op = rng.choice("+-*")
        lines.append(f"{a}{op}{b}={eval(f'{a}{op}{b}')}")  # noqa: S307 (digits and one operator)
    return lines + ENGLISH.split(". ") * 4


def train_bpe_tokenizer(out_dir: str | Path | None = None, *, vocab_size: int = 400, pad_is_eos: bool = False,
                        texts: list[str] | None = None):
    """Train a byte-level BPE tokenizer on ``texts`` (default ``corpus()``) and return it as a
    ``PreTrainedTokenizerFast`` (saved to ``out_dir`` when given).

    Special tokens <pad> <bos> <eos> <|end|> are ids 0..3; every encoded text starts with <bos>;
    ``pad_is_eos`` makes the pad token the EOS token (as many released tokenizers do). The chat
    template wraps each message as ``<|role|>content<|end|>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts if texts is not None else corpus(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=EOS if pad_is_eos else PAD,
        additional_special_tokens=[END_OF_TURN], chat_template=CHAT_TEMPLATE,
    )
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        wrapped.save_pretrained(out_dir)
    return wrapped


def build_tiny(arch: str, out_dir: str | Path, *, tied: bool | None = None, tokenizer=None,
               multi_eos: bool = False, pad_is_eos: bool = False, seed: int = 0, **overrides) -> Path:
    """Write a random-init ``arch`` causal LM (see ``ARCHITECTURES``) and its tokenizer to ``out_dir``.

    ``tied``: tie the input and output embeddings (None: the architecture's default). ``tokenizer``:
    a tokenizer from ``train_bpe_tokenizer`` (default: train one; ``pad_is_eos`` applies then).
    ``multi_eos``: the generation config lists two EOS ids (<eos> and <|end|>). ``overrides`` go to
    the config. Initialisation uses ``seed`` without touching the global RNG. Returns the directory.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown or unavailable architecture {arch!r}; choose from {', '.join(ARCHITECTURES)}")
    hf_logging.disable_progress_bar()
    tokenizer = tokenizer if tokenizer is not None else train_bpe_tokenizer(pad_is_eos=pad_is_eos)
    config_class, kwargs = ARCHITECTURES[arch]
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    kwargs = dict(kwargs, vocab_size=len(tokenizer), **ids, **overrides)
    if tied is not None:
        kwargs["tie_word_embeddings"] = tied
    config = config_class(**kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    generation = model.generation_config
    generation.bos_token_id, generation.pad_token_id = ids["bos_token_id"], ids["pad_token_id"]
    generation.eos_token_id = ([ids["eos_token_id"], tokenizer.convert_tokens_to_ids(END_OF_TURN)]
                               if multi_eos else ids["eos_token_id"])
    model.eval()
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
