"""Build a small Llama and a character tokenizer locally, and warm-start it on a task.

Nothing is downloaded: ``build_tiny_llama`` writes a ``LlamaForCausalLM`` (about 1M parameters at
hidden 128, 4 layers) and a character-level ``tokenizers`` tokenizer wrapped in
``PreTrainedTokenizerFast`` with ``save_pretrained``, so ``AutoModelForCausalLM.from_pretrained``
and ``AutoTokenizer.from_pretrained`` load the directory like any Hugging Face model.

``warmstart`` gives RL something to improve: supervised next-token training on the task's
prompt + answer strings (loss on answer tokens and EOS only) until the held-out greedy accuracy
first reaches ``threshold``. An RL run on a model at 0% reward learns nothing (every group has zero
variance); a model at about 30% has signal in most groups. Results are cached by task, model size,
seed and training settings, so the second call returns the directory at once.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from polyrl.errors import TrainingError
from polyrl.logging import StepProgress
from polyrl.rollout.episodes import EpisodeRunner
from polyrl.rollout.generator import SamplingParams
from polyrl.rollout.hf import HFGenerator
from polyrl.tasks import Task, get_task

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")  # ids 0, 1, 2, 3
DEFAULT_CHARSET = (
    "0123456789+-*/=()<>.,:;?!'\" \n"
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
)
META_FILE = "warmstart.json"
SHIPPED = Path(__file__).parent / "warmstarts"  # warm starts shipped with the package, one directory per task
MAX_POSITIONS = 256  # context of the tiny models (prompt + completion); the warm starts are built with it
WARMUP_STEPS = 50  # linear learning-rate warm-up of the supervised warm-start


def build_char_tokenizer(charset: str = DEFAULT_CHARSET):
    """Return a ``PreTrainedTokenizerFast`` with one token per character of ``charset``.

    Every input character is its own pre-token (a Split on the regex "[\\s\\S]"), mapped by a WordLevel
    model; unknown characters become <unk>. A <bos> is prepended to every encoded text; decoding
    concatenates the characters (Fuse decoder).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(charset))  # unique, order kept
    if not chars:
        raise ValueError("charset must contain at least one character")
    vocab = {token: index for index, token in enumerate([*SPECIAL_TOKENS, *chars])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def build_tiny_llama(
    out_dir: str | Path,
    *,
    charset: str = DEFAULT_CHARSET,
    hidden: int = 128,
    layers: int = 4,
    heads: int = 4,
    intermediate: int | None = None,
    max_positions: int = MAX_POSITIONS,
    seed: int = 0,
) -> Path:
    """Write a randomly initialised LlamaForCausalLM and its character tokenizer to ``out_dir``.

    ``intermediate`` defaults to 4 * hidden (hidden 128, 4 layers: about 1.05M parameters with the
    default charset). Initialisation uses ``seed`` without touching the global RNG.
    """
    model, tokenizer = _build(charset, hidden, layers, heads, intermediate, max_positions, seed)
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _build(charset: str, hidden: int, layers: int, heads: int, intermediate: int | None, max_positions: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # saving a 4 MB model locally needs no progress bar on stderr

    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
    tokenizer = build_char_tokenizer(charset)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=intermediate if intermediate is not None else 4 * hidden,
        max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.eval()
    return model, tokenizer


def check_warmstart(task: str, *, threshold: float = 0.30, seed: int = 0, hidden: int = 128, layers: int = 4,
                    heads: int = 4) -> None:
    """Refuse, in one line (``ConfigError``), settings that ``warmstart`` cannot build or train, before any work."""
    from polyrl.config import ConfigError
    from polyrl.tasks import TASKS

    if task not in TASKS:
        raise ConfigError(f"task = {task!r} is not allowed; known tasks: {', '.join(sorted(TASKS))}")
    if "data_file" in inspect.signature(TASKS[task]).parameters:
        raise ConfigError(f"task = {task!r} has no warm start (it reads its rows from --data-file): train it with "
                          f"`polyrl train --task {task} --data-file F --model DIR`, DIR a local Hugging Face model "
                          "directory")
    if not (math.isfinite(threshold) and 0.0 <= threshold <= 1.0):
        raise ConfigError(f"threshold = {threshold} is not allowed: a held-out accuracy in [0, 1]")
    if not 0 <= seed < 2**32:
        raise ConfigError(f"seed = {seed} is not allowed: an integer in [0, 2**32)")
    if hidden < 1 or hidden % (2 * heads):
        raise ConfigError(f"hidden = {hidden} is not allowed: a positive multiple of {2 * heads} ({heads} attention "
                          "heads of an even size, as rotary position embeddings need)")
    if layers < 1:
        raise ConfigError(f"layers = {layers} is not allowed: an integer >= 1")
    check_trainable(hidden, layers)


MAX_LAYERS = 1024  # building a layer takes milliseconds: --layers 1000000 built for hours before step 1


def check_trainable(hidden: int, layers: int, *, prefix: str = "") -> None:
    """Refuse (``ConfigError``, one line) a tiny Llama too deep to build or too large to train in this machine's
    memory: 16 hidden^2 parameters a layer (attention 4 h^2, a SwiGLU MLP of width 4 h 12 h^2), 16 bytes each while
    training (float32 weights, gradients and AdamW's two moments)."""
    from polyrl.config import ConfigError
    from polyrl.runs import check_fits

    if layers > MAX_LAYERS:
        raise ConfigError(f"{prefix}layers = {layers} is not allowed: at most {MAX_LAYERS} (a tiny model's depth)")
    check_fits({f"{prefix}hidden = {hidden} x {prefix}layers = {layers}": 16 * 16 * layers * hidden**2})


class WarmstartError(TrainingError):
    """Raised when warm-starting hits max_steps before reaching the accuracy threshold (a failed run: one line,
    exit code 1)."""


@dataclass(frozen=True)
class WarmstartResult:
    """Where the warm-started model is and how it got there."""

    path: str  # directory loadable with from_pretrained
    accuracy: float  # held-out greedy accuracy when training stopped
    steps: int  # optimizer steps taken
    seconds: float  # wall time of the training run (not of a cached call)
    cached: bool  # True when this call found the model in the cache


def warmstart(
    task: Task | str,
    out_dir: str | Path,
    *,
    threshold: float = 0.30,
    max_steps: int = 20_000,
    eval_every: int = 25,
    seed: int = 0,
    lr: float = 3e-3,
    batch_size: int = 128,
    eval_size: int = 256,
    hidden: int = 128,
    layers: int = 4,
    heads: int = 4,
    charset: str = DEFAULT_CHARSET,
    progress: bool = True,
) -> WarmstartResult:
    """Train a tiny Llama on ``task`` until held-out greedy accuracy first reaches ``threshold``.

    The model lands in ``out_dir/<task>-h<hidden>-l<layers>-seed<seed>-<hash>/`` (the hash covers
    every other setting); when that directory is complete the call returns it at once. Accuracy is
    the mean task reward of greedy completions on ``eval_size`` test prompts, measured every
    ``eval_every`` steps. ``max_steps`` is only a safety cap: reaching it raises WarmstartError.
    """
    if isinstance(task, str):
        check_warmstart(task, threshold=threshold, seed=seed, hidden=hidden, layers=layers, heads=heads)
        task = get_task(task)
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold}")
    for name, value in (("max_steps", max_steps), ("eval_every", eval_every), ("batch_size", batch_size),
                        ("eval_size", eval_size)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    settings = dict(task=task.name, threshold=threshold, eval_every=eval_every, seed=seed, lr=lr,
                    batch_size=batch_size, eval_size=eval_size, hidden=hidden, layers=layers, heads=heads,
                    charset=charset)
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]
    root = Path(out_dir)
    final = root / f"{task.name}-h{hidden}-l{layers}-seed{seed}-{digest}"
    if not (final / META_FILE).is_file():
        _copy_shipped(task.name, settings, final)
    if (final / META_FILE).is_file():
        meta = json.loads((final / META_FILE).read_text())
        return WarmstartResult(path=str(final), accuracy=meta["accuracy"], steps=meta["steps"],
                               seconds=meta["seconds"], cached=True)

    model, tokenizer = _build(charset, hidden, layers, heads, None, MAX_POSITIONS, seed)
    started = time.perf_counter()
    accuracy, steps = _train(model, tokenizer, task, threshold=threshold, max_steps=max_steps,
                             eval_every=eval_every, seed=seed, lr=lr, batch_size=batch_size,
                             eval_size=eval_size, progress=progress)
    seconds = time.perf_counter() - started
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    meta = dict(settings, accuracy=accuracy, steps=steps, seconds=seconds)
    (staging / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    if final.exists():  # an incomplete directory left by an interrupted run
        shutil.rmtree(final)
    os.replace(staging, final)
    return WarmstartResult(path=str(final), accuracy=accuracy, steps=steps, seconds=seconds, cached=False)


def _copy_shipped(task_name: str, settings: dict, final: Path) -> bool:
    """Put the warm start polyrl ships for these exact settings (``polyrl/warmstarts/<task>``) into the cache.

    It is the output of the same ``warmstart`` call, made once and committed, so a first run on a fresh machine
    starts in seconds instead of training for minutes. Copied through a temporary sibling, then renamed.
    """
    shipped = SHIPPED / task_name
    if not (shipped / META_FILE).is_file():
        return False
    meta = json.loads((shipped / META_FILE).read_text())
    if {k: meta.get(k) for k in settings} != settings:
        return False
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    shutil.copytree(shipped, staging, dirs_exist_ok=True)
    if final.exists():  # an incomplete directory left by an interrupted run
        shutil.rmtree(final)
    os.replace(staging, final)
    return True


def _train(model, tokenizer, task: Task, *, threshold: float, max_steps: int, eval_every: int, seed: int,
           lr: float, batch_size: int, eval_size: int, progress: bool) -> tuple[float, int]:
    """Supervised training loop; returns (accuracy, steps) at the first evaluation reaching threshold."""
    test = task.prompts("test", eval_size, seed)
    targets = [p.answer if p.demo is None else p.demo for p in test]
    answer_tokens = max(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in targets)
    greedy = SamplingParams(n=1, max_new_tokens=answer_tokens + 2, temperature=0.0)
    runner = EpisodeRunner(HFGenerator(model, tokenizer), tokenizer, task)  # multi-turn tasks call their tool
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (WARMUP_STEPS + 1)))
    best = accuracy = 0.0
    console = Console(quiet=not progress)
    with StepProgress(console, f"warm-start {task.name} to held-out accuracy {threshold:.2f}: step", max_steps) as bar:
        for step in range(1, max_steps + 1):
            model.train()
            batch = task.prompts("train", batch_size, seed=seed * 1_000_003 + step)
            input_ids, attention_mask, loss_mask = _supervised_batch(tokenizer, batch)
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
            token_loss = torch.nn.functional.cross_entropy(
                logits.transpose(1, 2), input_ids[:, 1:], reduction="none"
            )  # [B, L-1]
            loss = (token_loss * loss_mask).sum() / loss_mask.sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            bar.update(step, info=f"loss {loss.item():.3f}  acc {accuracy:.3f}")
            if step % eval_every == 0 or step == max_steps:
                model.eval()
                samples = runner.sample(test, greedy)
                accuracy = sum(task.reward(p, s.text)[0] for p, s in zip(test, samples)) / len(test)
                best = max(best, accuracy)
                if accuracy >= threshold:
                    return accuracy, step
    model.eval()
    raise WarmstartError(
        f"warm-start of {task.name!r} did not reach held-out greedy accuracy {threshold:.2f} within "
        f"max_steps={max_steps} (best {best:.3f}); raise max_steps or lower the threshold"
    )


def _supervised_batch(tokenizer, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt + answer + EOS; loss mask [B, L-1] on predictions of answer and EOS tokens."""
    prompts = tokenizer([p.text for p in batch], add_special_tokens=True)["input_ids"]
    answers = tokenizer([p.answer if p.demo is None else p.demo for p in batch], add_special_tokens=False)["input_ids"]
    rows = [p + a + [tokenizer.eos_token_id] for p, a in zip(prompts, answers)]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width - 1))
    for i, (row, prompt) in enumerate(zip(rows, prompts)):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention_mask[i, : len(row)] = 1
        loss_mask[i, len(prompt) - 1 : len(row) - 1] = 1.0  # position j predicts token j + 1
    return input_ids, attention_mask, loss_mask
