"""Load a policy from a local Hugging Face directory and compute completion log-probs cheaply.

``completion_logprobs`` is the only place where the trainer turns a model into per-token
log-probs, entropies and top-K log-probs. It never materialises the full ``[B, T, V]`` float32
logits: the base model runs once to give the final hidden states, and the LM head is applied to
``chunk_size`` completion tokens at a time. When gradients are needed the backward pass recomputes
one chunk's logits at a time instead of keeping every chunk's, and adds the head's weight gradient
into one buffer (``_ChunkedHead``). The automatic chunk size makes one chunk's logits about as large as the
hidden states of the scored tokens (N * H elements), which are in memory anyway (the sizing rule
of Liger-Kernel's fused linear cross-entropy). With a 152k vocabulary this is the difference
between gigabytes and megabytes per micro-batch.

Sampling settings (temperature, top-k, top-p) are applied by ``process_logits``, the one function
the rollout sampler also uses, so log-probs recomputed at the rollout weights equal the sampler's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from polyrl.errors import ConfigError
from polyrl.runs import cores
from polyrl.shared_prompt import distinct_prompts, kv_only_cache, shared_prompt_states

DType = Literal["float32", "bfloat16", "float16", "float64"]
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MIN_AUTO_CHUNK = 32  # smallest automatic chunk (tokens); tinier matmuls waste more time than they save memory


class ModelDirError(ConfigError, FileNotFoundError):
    """A model directory, its config.json or its tokenizer is missing: a ``ConfigError`` (one line naming the setting
    and the path) that callers catching ``FileNotFoundError`` still catch."""


def load_error(model_dir: str | Path, error: BaseException, *, setting: str = "model") -> ConfigError:
    """A ``ConfigError`` for a model directory a library could not load: one line naming the setting, the directory
    and what is wrong (the first line of the library's own message)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    what = lines[0] if lines else type(error).__name__
    return ConfigError(f"{setting} = {str(model_dir)!r}: cannot be loaded ({type(error).__name__}: {what}); "
                       "expected a Hugging Face model directory (config.json, weights, tokenizer)")


def check_model_dir(model_dir: str | Path, *, setting: str = "model") -> Path:
    """The directory as a Path; ``ModelDirError`` naming the setting and the path when it, its config.json or its
    tokenizer is missing (checked before any library is asked to load it: transformers would take a missing path for
    a Hub id and try to download it)."""
    path = Path(model_dir)
    named = f"{setting} = {str(path)!r}"
    if not path.exists():
        raise ModelDirError(f"{named}: model directory not found")
    if not path.is_dir():
        raise ModelDirError(f"{named}: is a file, not a model directory (a Hugging Face directory with config.json)")
    if not (path / "config.json").is_file():
        raise ModelDirError(f"{named}: no config.json in the model directory (not a Hugging Face model?)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelDirError(f"{named}: no tokenizer in the model directory (expected {' or '.join(TOKENIZER_FILES)})")
    return path


def load_tokenizer(model_dir: str | Path, *, setting: str = "model"):
    """``AutoTokenizer.from_pretrained`` on a local directory; a damaged tokenizer is a one-line ``ConfigError``."""
    from transformers import AutoTokenizer

    path = check_model_dir(model_dir, setting=setting)
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 (tokenizers raises bare Exception, JSON ValueError, OSError...)
        raise load_error(model_dir, e, setting=setting) from e


def load_model(model_dir: str | Path, *, dtype: str | torch.dtype = "auto", setting: str = "model") -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` on a local directory; a damaged config.json, missing or truncated
    weights are a one-line ``ConfigError`` naming ``setting`` and the directory."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    path = check_model_dir(model_dir, setting=setting)
    hf_logging.disable_progress_bar()  # a local load takes milliseconds; its bar would only clutter stderr
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except Exception as e:  # noqa: BLE001 (OSError, SafetensorError, ValueError, KeyError... from the libraries)
        raise load_error(model_dir, e, setting=setting) from e


def load_policy(model_dir: str | Path, *, dtype: DType = "float32", threads: int | None = None,
                setting: str = "model"):
    """Load a causal LM and its tokenizer from a local directory (nothing is downloaded).

    Returns ``(model, tokenizer)``; the model is in eval mode. ``threads`` sets
    ``torch.set_num_threads`` for the process (default: the cores it may run on, ``runs.cores``).
    Raises ``ModelDirError`` (a ``ConfigError`` and a ``FileNotFoundError``) naming ``setting`` and the path when
    the directory, its config.json or its tokenizer is missing, and ``ConfigError`` (one line naming ``setting``, the
    directory and the library's complaint) when one of them cannot be loaded: a damaged config.json or tokenizer,
    missing or truncated weights.
    """
    path = check_model_dir(model_dir, setting=setting)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads if threads is not None else cores())
    tokenizer = load_tokenizer(path, setting=setting)
    model = load_model(path, dtype=DTYPES[dtype], setting=setting)
    model.eval()
    return model, tokenizer


def disable_dropout(model: nn.Module) -> nn.Module:
    """Turn off the dropout a model's config sets (GPT-2's and OPT's 0.1), as TRL's ``disable_dropout`` does: the
    training pass runs in train mode, where dropout would make its log-probs differ from the rollout's (pi_old and
    the KL to a reference computed on a perturbed policy: ``rollout/logp_mismatch`` 0.05 on GPT-2). Every
    ``nn.Dropout`` gets p = 0, and so does each float attribute named ``*dropout*`` or ``*pdrop*`` of a module (OPT's
    and Llama's attention pass theirs to the kernel) and of the config. Adapters added later keep their own."""
    def off(names: dict) -> list[str]:
        return [k for k, v in names.items() if ("dropout" in k or "pdrop" in k) and isinstance(v, float) and v]

    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for name in off(vars(module)):
            setattr(module, name, 0.0)
    for name in off(model.config.to_dict()):
        setattr(model.config, name, 0.0)
    return model


def context_length(model_or_config) -> int | None:
    """The positions a model can embed, where that is a hard limit: ``config.max_position_embeddings`` (GPT-2's
    ``n_positions`` through transformers' attribute map) of a model with a learned position table; None for a rotary
    model (``rope_*`` in its config) or a config that names no limit.

    Convention: a prompt and its ``max_new_tokens`` must fit in this (vLLM's rule, prompt + max_tokens <=
    max_model_len): a learned table has no row past it (GPT-2 ended in an IndexError). vLLM applies the rule to every
    model; here a rotary model may run past max_position_embeddings (positions it was not trained on, as
    transformers' generate allows), so runs started that way keep working; ``beyond_context`` notes it."""
    config = getattr(model_or_config, "config", model_or_config)
    if any(getattr(config, name, None) for name in ("rope_parameters", "rope_scaling", "rope_theta")):
        return None
    return _positions(config)


def _positions(config) -> int | None:
    n = getattr(config, "max_position_embeddings", None)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def model_config(model_dir: str | Path):
    """The config of a local model directory, from its config.json alone; None where it cannot be read (loading the
    model says why, in one line)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except Exception:  # noqa: BLE001 (a missing or damaged config.json: load_model refuses it with its own line)
        return None


def beyond_context(config, max_new_tokens: int) -> str | None:
    """A note when ``max_new_tokens`` alone reaches past a rotary model's ``max_position_embeddings`` (positions it
    was not trained on; a learned table refuses it instead, ``context_length``), else None."""
    n = _positions(config)
    if n is None or context_length(config) is not None or max_new_tokens < n:
        return None
    return (f"max_new_tokens = {max_new_tokens} reaches past the {n} positions the model was trained on "
            "(max_position_embeddings): its rotary positions run on untrained")


def check_context(prompt_tokens: int, max_new_tokens: int, context: int | None, *, prompt: str = "a prompt",
                  model: str = "the model") -> None:
    """Refuse (``ConfigError``, one line) a prompt whose tokens and ``max_new_tokens`` exceed ``context``."""
    if context is None or prompt_tokens + max_new_tokens <= context:
        return
    if max_new_tokens >= context:
        raise ConfigError(f"max_new_tokens = {max_new_tokens} leaves no room for a prompt in the context of {model} "
                          f"({context} positions, max_position_embeddings); allowed: below {context}")
    raise ConfigError(f"{prompt} has {prompt_tokens} tokens, and with max_new_tokens = {max_new_tokens} it needs "
                      f"{prompt_tokens + max_new_tokens} positions, beyond the context of {model} ({context}, "
                      "max_position_embeddings): shorten the prompt or lower max_new_tokens")


def process_logits(
    logits: Tensor, *, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> Tensor:
    """Apply temperature, then top-k, then top-p to logits [..., V]; filtered entries become -inf.

    The order and the rules are those of Hugging Face's logits warpers: top-k keeps every token
    whose logit ties the k-th largest; top-p keeps the smallest prefix of tokens sorted by
    probability whose mass reaches ``top_p`` (a token is removed when the mass before it already
    reaches ``top_p``, as ``TopPLogitsWarper`` and vLLM do; the most probable token is always kept). ``top_k=None`` and
    ``top_p=None`` (or 1.0) disable the filters. log_softmax of the result is the sampling
    distribution.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for a sampling distribution, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p}")
    z = logits / temperature if temperature != 1.0 else logits
    if top_k is not None and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = sorted_z.softmax(dim=-1)
        remove_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        remove_sorted[..., 0] = False  # the most probable token, whatever the rounding
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        z = z.masked_fill(remove, float("-inf"))
    return z


def linear_head(model: nn.Module) -> nn.Linear:
    """Return the model's LM head, refusing models whose logits are more than ``head(hidden)``, soft-capped.

    Both the sampler and ``completion_logprobs`` compute logits as ``head_logits(hidden, head,
    softcap=logit_softcap(model))`` from the base model's final hidden states, so a model that
    rescales its logits (Cohere, Granite, Falcon-H1) would be silently wrong: it is refused with a clear error
    instead. Final-logit soft-capping (Gemma 2) is applied by ``head_logits``.
    """
    logit_softcap(model)  # refuses a cap the architecture does not apply
    config = model.config.to_dict()
    for key in ("logit_scale", "logits_scaling", "lm_head_multiplier"):
        if config.get(key) not in (None, 1.0):
            raise ValueError(f"models with {key}={config[key]} (rescaled logits) are not supported")
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise TypeError(f"the LM head must be an nn.Linear, got {type(head).__name__}")
    return head


def logit_softcap(model: nn.Module) -> float | None:
    """The model's final-logit soft-cap ``c`` (logits -> c * tanh(logits / c); Gemma 2), or None.

    Only an architecture whose config class declares ``final_logit_softcapping`` applies it in
    transformers; the attribute set on any other config (which transformers would ignore) is refused
    as ambiguous.
    """
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap is None:
        return None
    if not hasattr(type(model.config), "final_logit_softcapping"):
        raise ValueError(
            f"final_logit_softcapping={cap} is set on a {type(model.config).__name__}, whose model does not "
            "apply it: not supported (ambiguous logits)"
        )
    return float(cap)


def head_logits(states: Tensor, head: nn.Linear, *, fp32_head: bool = False, softcap: float | None = None) -> Tensor:
    """Logits [..., V] of hidden states [..., H], upcast to at least float32.

    ``fp32_head`` (ScaleRL, arXiv 2510.13786) casts the states and the head weights to float32
    before the matmul instead of only upcasting its result. ``softcap`` (``logit_softcap(model)``)
    soft-caps the upcast logits as transformers does: ``softcap * tanh(logits / softcap)``.
    """
    return _finish_logits(_head_matmul(states, head.weight, head.bias, fp32_head), softcap)


def float32_head(head: nn.Linear) -> nn.Linear:
    """A float32 copy of a lower-precision LM head without gradients (the head itself when it is float32 already).

    A loop that applies the head at every token with ``fp32_head`` (the sampler) multiplies by this copy, made
    once, instead of casting a [V, H] weight at every call.
    """
    if head.weight.dtype == torch.float32:
        return head
    copy = torch.nn.utils.skip_init(nn.Linear, head.in_features, head.out_features, bias=head.bias is not None,
                                    device=head.weight.device, dtype=torch.float32)
    with torch.no_grad():
        copy.weight.copy_(head.weight)
        if head.bias is not None:
            copy.bias.copy_(head.bias)
    return copy.requires_grad_(False)


def _head_weights(weight: Tensor, bias: Tensor | None, fp32_head: bool) -> tuple[Tensor, Tensor | None]:
    """The head's weight and bias as the matmul uses them: float32 copies when ``fp32_head``. Cast them once
    per call rather than once per chunk or token (a [V, H] copy each time for a bfloat16 model)."""
    if not fp32_head:
        return weight, bias
    return weight.float(), None if bias is None else bias.float()


def _head_matmul(states: Tensor, weight: Tensor, bias: Tensor | None, fp32_head: bool) -> Tensor:
    """``states @ weight.T + bias``, in float32 when ``fp32_head``, else in the weights' dtype."""
    weight, bias = _head_weights(weight, bias, fp32_head)  # no copy when they already are float32
    return F.linear(states.float() if fp32_head else states, weight, bias)


def _finish_logits(logits: Tensor, softcap: float | None) -> Tensor:
    """Upcast head outputs to at least float32, then soft-cap them (``softcap * tanh(logits / softcap)``)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


@dataclass
class TokenLogprobs:
    """Per-token outputs of ``completion_logprobs``; 0 at positions where completion_mask == 0."""

    logp: Tensor  # [B, T] log-prob of each completion token under the processed distribution
    entropy: Tensor | None = None  # [B, T] entropy of the processed distribution (with_entropy=True)
    topk_ids: Tensor | None = None  # [B, T, K] long; column 0 = the sampled token
    topk_logp: Tensor | None = None  # [B, T, K] log-probs at topk_ids

    def tensors(self) -> tuple[Tensor | None, ...]:
        """(logp, entropy, topk_ids, topk_logp): the fields in order, uncopied."""
        return self.logp, self.entropy, self.topk_ids, self.topk_logp

    def cpu(self) -> TokenLogprobs:
        """The same on the CPU (differentiable: a backward flows to the device they were computed on)."""
        return TokenLogprobs(*(None if t is None else t.cpu() for t in self.tensors()))


def completion_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_mask: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    chunk_size: int | None = None,
    with_entropy: bool = True,
    fp32_head: bool = False,
    topk: int = 0,
    topk_ids: Tensor | None = None,
    share_prompts: bool = False,
) -> TokenLogprobs:
    """Compute log-probs [B, T] (and entropy, top-K) of the completion tokens, chunk by chunk.

    Layout: ``input_ids`` and ``attention_mask`` are [B, L] = left-padded prompt followed by the
    right-padded completion block of T = ``completion_mask.shape[1]`` columns (the last T columns
    of ``input_ids``); ``completion_mask`` [B, T] marks the completion tokens to score. Position ids
    are ``cumsum(attention_mask) - 1``, as in the sampler. Only tokens with completion_mask == 1
    pass through the LM head, ``chunk_size`` tokens at a time (None: ceil(N * H / V), at least
    32); every output is 0 elsewhere.

    ``topk`` = K > 0 also returns top-K ids/log-probs: column 0 is the scored token, columns
    1..K-1 the K-1 most probable other tokens of this model's processed distribution. Passing
    ``topk_ids`` [B, T, K] instead evaluates the log-probs at those ids (the rollout policy's
    support, for DPPO-style trust regions). ``fp32_head``: see ``head_logits``; logits are always
    upcast to at least float32 per chunk. ``share_prompts``: run each distinct prompt once when rows share one
    (``polyrl.shared_prompt``; the same outputs and gradients up to float rounding).
    Gradients flow to every model parameter through ``logp``, ``entropy`` and ``topk_logp``.
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids and attention_mask must both be [B, L], got {tuple(input_ids.shape)} and "
            f"{tuple(attention_mask.shape)}"
        )
    batch, length = input_ids.shape
    if completion_mask.dim() != 2 or completion_mask.shape[0] != batch:
        raise ValueError(f"completion_mask must be [B={batch}, T], got {tuple(completion_mask.shape)}")
    width = completion_mask.shape[1]
    if not 1 <= width < length:
        raise ValueError(f"completion width T={width} must be in [1, L) with L={length} (a prompt token is needed)")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
    if topk < 0:
        raise ValueError(f"topk must be >= 0, got {topk}")
    if topk_ids is not None and (topk_ids.dim() != 3 or topk_ids.shape[:2] != completion_mask.shape):
        raise ValueError(f"topk_ids must be [B, T, K] matching completion_mask, got {tuple(topk_ids.shape)}")
    head = linear_head(model)
    if topk > head.out_features:
        raise ValueError(f"topk={topk} exceeds the vocabulary size {head.out_features}")

    position_ids = (attention_mask.long().cumsum(dim=-1) - 1).clamp_min(0)
    shared = distinct_prompts(input_ids, attention_mask, width) if share_prompts and kv_only_cache(model) else None
    if shared is not None:
        hidden = shared_prompt_states(model, input_ids, attention_mask, position_ids, width, *shared)  # [B, T, H]
    else:
        hidden = model.base_model(  # the last column predicts nothing and nothing scored attends to it: not run
            input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1], position_ids=position_ids[:, :-1],
            use_cache=False,
        ).last_hidden_state[:, length - width - 1 :]  # [B, T, H]; position i predicts token i+1
    selected = completion_mask.bool()  # [B, T]
    states = hidden[selected]  # [N, H]
    targets = input_ids[:, length - width :][selected]  # [N]
    given_ids = topk_ids[selected] if topk_ids is not None else None  # [N, K]

    if chunk_size is None:  # one chunk's logits [n, V] about as large as the hidden states [N, H]
        chunk_size = max(MIN_AUTO_CHUNK, -(-states.shape[0] * head.in_features // head.out_features))
    settings = dict(
        temperature=temperature, top_k=top_k, top_p=top_p, with_entropy=with_entropy, topk=topk,
        fp32_head=fp32_head, softcap=logit_softcap(model),
    )
    needs_graph = torch.is_grad_enabled() and (states.requires_grad or head.weight.requires_grad)
    if needs_graph:
        flat = _ChunkedHead.apply(states, head.weight, head.bias, targets, given_ids, chunk_size, settings)
        pieces = [flat]  # outputs that were not asked for are empty and never read
    else:
        pieces = _head_chunks(states, head.weight, head.bias, targets, given_ids, chunk_size, settings)

    out_dtype = torch.promote_types(head.weight.dtype, torch.float32)
    k = given_ids.shape[-1] if given_ids is not None else topk

    def scatter(index: int, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        values = [p[index] for p in pieces]
        flat = torch.cat(values) if values else torch.zeros((0, *shape[2:]), dtype=dtype, device=hidden.device)
        mask = selected.reshape(*selected.shape, *([1] * (len(shape) - 2))).expand(shape)
        return torch.zeros(shape, dtype=dtype, device=hidden.device).masked_scatter(mask, flat.to(dtype))

    return TokenLogprobs(
        logp=scatter(0, (batch, width), out_dtype),
        entropy=scatter(1, (batch, width), out_dtype) if with_entropy else None,
        topk_ids=scatter(2, (batch, width, k), torch.long) if k > 0 else None,
        topk_logp=scatter(3, (batch, width, k), out_dtype) if k > 0 else None,
    )


class _ChunkedHead(torch.autograd.Function):
    """The LM head and per-token statistics of N tokens, chunk by chunk, recomputed chunk by chunk in backward.

    Forward keeps only the hidden states [N, H] (and the top-K ids it chose). Backward recomputes one chunk's
    logits at a time, takes the gradient of that chunk's statistics with respect to its logits [n, V] by autograd,
    and applies the head's matmul gradients by hand: ``grad_states = grad_logits @ W`` and
    ``grad_W += grad_logits.T @ states`` into one [V, H] buffer for the whole backward. Autograd over
    per-chunk checkpoints would allocate a fresh [V, H] weight gradient per chunk and add it up (at a 152k
    vocabulary, hundreds of MB written, page-faulted and freed per chunk); a frozen head (LoRA) gets no weight
    gradient at all. Outputs not asked for are empty tensors.
    """

    @staticmethod
    def forward(ctx, states, weight, bias, targets, given_ids, chunk_size, settings):
        pieces = _head_chunks(states, weight, bias, targets, given_ids, chunk_size, settings)
        empty = states.new_zeros((0,), dtype=torch.promote_types(weight.dtype, torch.float32))

        def cat(index: int) -> Tensor | None:
            values = [p[index] for p in pieces if p[index] is not None]
            return torch.cat(values) if values else None

        logp, entropy, ids, topk_logp = (cat(i) for i in range(4))
        if logp is None:  # no token scored
            logp = empty
        ctx.save_for_backward(states, weight, bias, targets, ids)
        ctx.chunk_size, ctx.settings = chunk_size, settings
        ctx.set_materialize_grads(False)  # an output the loss does not use (a metric) gets None: not recomputed
        no_ids = torch.zeros((0,), dtype=torch.long, device=states.device)
        ctx.mark_non_differentiable(ids if ids is not None else no_ids)
        return (logp, empty if entropy is None else entropy, no_ids if ids is None else ids,
                empty if topk_logp is None else topk_logp)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy, _grad_ids, grad_topk_logp):
        states, weight, bias, targets, ids = ctx.saved_tensors
        chunk, settings = ctx.chunk_size, ctx.settings
        need_states, need_weight, need_bias = ctx.needs_input_grad[:3]
        w, b = _head_weights(weight, bias, settings["fp32_head"])
        grad_states = torch.zeros_like(states) if need_states else None
        grad_w = torch.zeros_like(w) if need_weight else None
        grad_b = torch.zeros_like(b) if need_bias and b is not None else None
        stats = {k: v for k, v in settings.items() if k not in ("fp32_head", "softcap")}
        stats["with_entropy"] = settings["with_entropy"] and grad_entropy is not None
        wanted = [(0, grad_logp), (1, grad_entropy if stats["with_entropy"] else None), (3, grad_topk_logp)]
        wanted = [(index, grad) for index, grad in wanted if grad is not None]
        if ids is None or grad_topk_logp is None:
            ids, stats["topk"] = None, 0
        if not wanted:
            return None, None, None, None, None, None, None
        for start in range(0, states.shape[0], chunk):
            rows = slice(start, start + chunk)
            s = states[rows].to(w.dtype)
            with torch.no_grad():
                z = F.linear(s, w, b)  # [n, V]
            z.requires_grad_(True)
            with torch.enable_grad():
                logits = _finish_logits(z, settings["softcap"])
                outs = _chunk_stats(logits, targets[rows], None if ids is None else ids[rows], **stats)
                pairs = [(outs[index], grad[rows]) for index, grad in wanted]
                (grad_z,) = torch.autograd.grad([o for o, _ in pairs], [z], [g.to(o.dtype) for o, g in pairs])
            grad_z = grad_z.to(w.dtype)
            if grad_states is not None:
                grad_states[rows] = grad_z @ w
            if grad_w is not None:
                grad_w.addmm_(grad_z.t(), s)
            if grad_b is not None:
                grad_b += grad_z.sum(0)
        to = lambda g, like: None if g is None else g.to(like.dtype)  # noqa: E731
        return grad_states, to(grad_w, weight), to(grad_b, bias), None, None, None, None


def _head_chunks(states: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, given_ids: Tensor | None,
                 chunk_size: int, settings: dict) -> list[tuple[Tensor | None, ...]]:
    """``_head_chunk`` over N tokens, ``chunk_size`` at a time, the head's weights cast once (not once per chunk)."""
    w, b = _head_weights(weight, bias, settings["fp32_head"])
    return [
        _head_chunk(states[i : i + chunk_size], targets[i : i + chunk_size],
                    None if given_ids is None else given_ids[i : i + chunk_size], w, b, **settings)
        for i in range(0, states.shape[0], chunk_size)
    ]


def _head_chunk(
    states: Tensor,
    targets: Tensor,
    given_ids: Tensor | None,
    weight: Tensor,
    bias: Tensor | None,
    *,
    fp32_head: bool,
    softcap: float | None,
    **stats,
) -> tuple[Tensor | None, ...]:
    """Head, sampling filters and per-token statistics for N tokens: (logp, entropy, ids, topk_logp)."""
    logits = _finish_logits(_head_matmul(states, weight, bias, fp32_head), softcap)  # [N, V]
    return _chunk_stats(logits, targets, given_ids, **stats)


def _chunk_stats(
    logits: Tensor,
    targets: Tensor,
    given_ids: Tensor | None,
    *,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    with_entropy: bool,
    topk: int,
) -> tuple[Tensor | None, ...]:
    """Sampling filters and per-token statistics of logits [N, V]: (logp, entropy, ids, topk_logp)."""
    logprobs = process_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p).log_softmax(dim=-1)
    logp = logprobs.gather(-1, targets[:, None]).squeeze(-1)  # [N]
    entropy = None
    if with_entropy:
        filtered = top_k is not None or (top_p is not None and top_p < 1.0)
        # Filtered entries are -inf and 0 * -inf would give nan (and nan gradients): zero them first.
        finite = logprobs.masked_fill(torch.isinf(logprobs), 0.0) if filtered else logprobs
        entropy = -(logprobs.exp() * finite).sum(dim=-1)
    ids = given_ids
    if ids is None and topk > 0:
        others = logprobs.detach().scatter(-1, targets[:, None], float("-inf"))
        ids = torch.cat([targets[:, None], others.topk(topk - 1, dim=-1).indices], dim=-1)  # [N, K]
    topk_logp = logprobs.gather(-1, ids) if ids is not None else None
    return logp, entropy, ids, topk_logp
