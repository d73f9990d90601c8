"""Transformers sampling backend with its own KV-cache decode loop.

This loop computes logits with ``polyrl.model.head_logits`` (optionally with the float32 head of
ScaleRL) and filters them with ``process_logits`` — the same functions the trainer calls — so
recomputed log-probs equal rollout log-probs at the same weights.

Why not ``model.generate`` (measured with ``benchmarks/generation.py`` on 2 CPU threads, float32,
8 prompts x 4, 64 new tokens): its processed scores match the trainer's recomputation as closely as
this loop (mean |delta log-prob| ~1e-7 both), but it is slower (0.85x the tokens/s at T = 1, 0.6x with
top-p 0.9 / top-k 20), it draws from one batch-wide RNG, not the per-row keyed uniforms that make
rollouts reproducible across workers and batch sizes, and it has no hook for agency transfer's arbiter.

Batches are LEFT padded with explicit position ids ``cumsum(attention_mask) - 1``; each step feeds
one token per row with the cache (``kv_cache.decode_cache``: keys written in place, not concatenated), and
a group's copies of one prompt share one prefill. Rows that sampled EOS are dropped from the batch and the
cache as soon as they finish, so long-tail rows do not pay for finished ones. The
only Python work per step is the loop itself and one ``any()`` check.

Sampling is per row, never per batch: each row (one completion) has a key, and its random numbers
are uniforms drawn once per decode batch from generators seeded by ``(seed, key)`` (one stream for
the tokens, another for the agency coins), indexed by the row's original position and the step. A
token is drawn by inverse CDF of the processed distribution with the row's uniform of that step
(``draw_tokens``). So a row's completion does not depend on the rows beside it, the batch size or
the order of the rows: rollouts can be split across processes and still reproduce a single call.

With an ``AgencyArbiter`` attached (agency transfer), a frozen baseline model decodes alongside with
its own cache, the arbiter picks each token from the baseline or the learner, and the reported
log-prob is the mixture's (``rollout/agency/arbiter.py``).
"""

from __future__ import annotations

import contextlib
import secrets

import numpy as np
import torch
from torch import Tensor, nn

from polyrl.errors import TrainingError
from polyrl.model import context_length, float32_head, head_logits, linear_head, logit_softcap, process_logits
from polyrl.rollout.agency.arbiter import AgencyArbiter
from polyrl.rollout.generator import Sample, SamplingParams, check_prompts_fit, draw_tokens, eos_token_ids
from polyrl.rollout.kv_cache import decode_cache, fill_order
from polyrl.shared_prompt import cache_keyword, distinct_prompts, kv_only_cache
from polyrl.tasks.chat import prompt_ids as encode_prompts

TOKENS, COINS = 0, 1  # the two random streams of a row


class HFGenerator:
    """Sample completions from a transformers causal LM on its own device."""

    def __init__(self, model: nn.Module, tokenizer, *, max_batch_size: int = 256, fp32_head: bool = False) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.head = linear_head(model)
        self.softcap = logit_softcap(model)  # Gemma 2's final-logit soft-cap, as in completion_logprobs
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.fp32_head = fp32_head  # float32 LM head, as completion_logprobs(fp32_head=True)
        self.eos_ids = eos_token_ids(model.generation_config.eos_token_id, tokenizer, "HFGenerator")
        # The filler of padded slots is never attended to; any valid id works.
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.arbiter: AgencyArbiter | None = None  # agency transfer: mix a frozen baseline into sampling
        self._heads: dict[int, nn.Module] = {}  # id(model) -> the head a decode call multiplies by (float32_head)

    def load_weights(self, state_dict: dict[str, Tensor]) -> None:
        """Copy the trainer's weights into the sampling model (strict: names and shapes must match)."""
        with torch.no_grad():
            self.model.load_state_dict(state_dict, strict=True)

    def generate(self, prompts: list[str], params: SamplingParams, keys: list[int] | None = None) -> list[Sample]:
        """Sample ``params.n`` completions per prompt (plain texts), grouped by prompt, in micro-batches (``keys``:
        see below)."""
        return self.generate_ids(encode_prompts(self.tokenizer, list(prompts)), params, keys)

    def generate_ids(self, prompt_ids: list[list[int]], params: SamplingParams,
                     keys: list[int] | None = None) -> list[Sample]:
        """The same from token ids (multi-turn and tree continuations condition on token prefixes).

        ``keys``: one per row (prompt ``i``'s ``n`` copies in order), default the row's index ``i * n + j``. A
        row's draws depend only on ``(params.seed, key)``; without a seed, one random base per call.
        """
        for index, ids in enumerate(prompt_ids):
            if not ids:
                raise ValueError(f"prompt {index} tokenizes to no tokens; nothing to condition on")
        check_prompts_fit(prompt_ids, params.max_new_tokens, self._context(), self.tokenizer)
        rows = [(index, ids) for index, ids in enumerate(prompt_ids) for _ in range(params.n)]
        keys = list(range(len(rows))) if keys is None else list(keys)
        if len(keys) != len(rows):
            raise ValueError(f"generate_ids: {len(keys)} keys for {len(rows)} rows (one per prompt and copy)")
        base = secrets.randbits(64) if params.seed is None else params.seed
        device = next(self.model.parameters()).device
        samples: list[Sample] = []
        for start in range(0, len(rows), self.max_batch_size):
            chunk = rows[start : start + self.max_batch_size]
            chunk_ids = [ids for _, ids in chunk]
            chunk_keys = keys[start : start + self.max_batch_size]
            uniforms = _uniforms(base, chunk_keys, TOKENS, params.max_new_tokens).to(device)
            coins = _uniforms(base, chunk_keys, COINS, params.max_new_tokens + 1).to(device)
            with _eval_mode(self.model, self.arbiter.baseline if self.arbiter is not None else None):
                tokens, logps, lengths, stopped, from_b, sq = self._decode(chunk_ids, params, uniforms, coins, device)
            completions = [row[:n] for row, n in zip(tokens.tolist(), lengths.tolist())]
            texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
            for (index, ids), completion, row_logps, stop, text, n_b, row_sq in zip(
                chunk, completions, logps.tolist(), stopped.tolist(), texts, from_b.tolist(),
                sq.tolist() if params.sum_pi_sq else [None] * len(chunk)
            ):
                samples.append(
                    Sample(
                        prompt_index=index,
                        prompt_token_ids=list(ids),
                        completion_token_ids=completion,
                        logprobs=row_logps[: len(completion)],
                        finish_reason="stop" if stop else "length",
                        text=text,
                        baseline_tokens=n_b,
                        sum_pi_sq=None if row_sq is None else row_sq[: len(completion)],
                    )
                )
        return samples

    def _context(self) -> int | None:
        """The positions every decoding model can attend over (the learner's, and an agency baseline's)."""
        models = [self.model] + ([self.arbiter.baseline] if self.arbiter is not None else [])
        known = [n for n in map(context_length, models) if n is not None]
        return min(known) if known else None

    @torch.inference_mode()
    def _decode(
        self, prompt_ids: list[list[int]], params: SamplingParams, uniforms: Tensor, coins: Tensor,
        device: torch.device,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Decode one left-padded batch: tokens [N, S], log-probs [N, S], lengths [N], stopped [N],
        baseline-chosen token counts [N], sum_v pi_v^2 of each step's distribution [N, S] (0 unless
        ``params.sum_pi_sq``).

        ``uniforms`` [N, S]: each row's token draw per step; ``coins`` [N, S + 1]: its agency coins (column 0
        the sequence-mode coin, column 1 + t the token-mode coin of step t).
        """
        count, width, steps = len(prompt_ids), max(len(ids) for ids in prompt_ids), params.max_new_tokens
        input_ids = torch.full((count, width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((count, width), dtype=torch.long)
        for row, ids in enumerate(prompt_ids):
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids) :] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp_min(0)
        eos_ids = torch.tensor(sorted({*self.eos_ids, *params.stop_token_ids}), device=device)
        arbiter = self.arbiter if self.arbiter is not None and self.arbiter.active else None
        if arbiter is not None and params.sum_pi_sq:
            raise ValueError("SamplingParams.sum_pi_sq is not recorded under agency transfer (a mixture policy)")

        tokens = torch.full((count, steps), self.pad_id, dtype=torch.long, device=device)
        logps = torch.zeros((count, steps), dtype=torch.float32, device=device)
        sq = torch.zeros((count, steps), dtype=torch.float32, device=device)
        lengths = torch.zeros(count, dtype=torch.long, device=device)
        stopped = torch.zeros(count, dtype=torch.bool, device=device)
        rows = torch.arange(count, device=device)  # original row of each live batch row
        next_position = position_ids[:, -1] + 1  # [n]
        shared = distinct_prompts(input_ids, attention_mask, 0)  # a group's rows share one prefill
        cache = decode_cache(self.model.config, width + steps)  # keys written in place, not concatenated
        self._heads = {id(self.model): self._sampling_head(self.head)}  # a float32 copy made once per call
        logits = self._prefill(input_ids, attention_mask, position_ids, cache, shared)
        keep_rows = not kv_only_cache(self.model)  # conv/recurrent states cannot drop rows: finished ones stay
        done = torch.zeros(count, dtype=torch.bool, device=device)
        if keep_rows and arbiter is not None:
            raise ValueError("agency transfer needs a model whose cache drops finished rows (keys and values only); "
                             "this one keeps recurrent states (a linear-attention or state-space model)")
        if arbiter is not None:
            mix = arbiter.start(coins[:, 0])
            self._heads[id(arbiter.baseline)] = self._sampling_head(linear_head(arbiter.baseline))
            base_cache = decode_cache(arbiter.baseline.config, width + steps)
            base_logits = self._prefill(input_ids, attention_mask, position_ids, base_cache, shared, arbiter.baseline)
        for step in range(steps):
            if arbiter is None:
                token, logp, dist = _pick(logits, params, uniforms[rows, step])
                if params.sum_pi_sq:  # sum_v pi_v^2 = exp(logsumexp(2 log pi)), of the distribution drawn from
                    sq[rows, step] = dist.mul(2).logsumexp(dim=-1).exp()
            else:
                token, logp = arbiter.pick(_processed(logits, params), _processed(base_logits, params),
                                           params.temperature == 0, uniforms[rows, step], coins[rows, step + 1], mix,
                                           rows)
            tokens[rows, step] = token
            logps[rows, step] = logp
            finished = torch.isin(token, eos_ids)
            if keep_rows:  # finished rows stay in the batch: what they draw past their EOS lies beyond their length
                finished &= ~done
                lengths[rows[~done]] = step + 1
                stopped[rows] |= finished
                done |= finished
            else:
                lengths[rows] = step + 1
                stopped[rows] = finished
            if step == steps - 1 or bool((done if keep_rows else finished).all()):
                break
            if not keep_rows and bool(finished.any()):
                live = fill_order(finished)  # the live rows, ordered to move the fewest cache rows
                rows, token, next_position = rows[live], token[live], next_position[live]
                attention_mask = attention_mask[live]
                cache.batch_select_indices(live)
                if arbiter is not None:
                    base_cache.batch_select_indices(live)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((rows.shape[0], 1))], dim=1)
            logits = self._next_logits(token[:, None], attention_mask, next_position[:, None], cache)
            if arbiter is not None:
                base_logits = self._next_logits(token[:, None], attention_mask, next_position[:, None], base_cache,
                                                arbiter.baseline)
            next_position = next_position + 1
        self._heads = {}  # a float32 copy of the head is not kept between calls
        from_b = mix.baseline_tokens if arbiter is not None else torch.zeros(count, dtype=torch.long)
        return tokens.cpu(), logps.cpu(), lengths.cpu(), stopped.cpu(), from_b.cpu(), sq.cpu()

    def _sampling_head(self, head: nn.Module) -> nn.Module:
        """The head a decode call multiplies by: with ``fp32_head`` a float32 copy (``float32_head``), else itself."""
        return float32_head(head) if self.fp32_head else head

    def _prefill(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, cache,
                 shared: tuple[Tensor, Tensor] | None, model: nn.Module | None = None) -> Tensor:
        """Run the prompts into ``cache``; logits [N, V] of their last token. ``shared`` = (first row of each distinct
        prompt, each row's prompt) from ``distinct_prompts``: each distinct prompt runs once and the cache is then
        gathered out to the rows (a group's G copies of one prompt cost one prefill)."""
        if shared is None:
            return self._next_logits(input_ids, attention_mask, position_ids, cache, model)
        first, inverse = shared
        logits = self._next_logits(input_ids[first], attention_mask[first], position_ids[first], cache, model)
        cache.reorder_cache(inverse)
        return logits[inverse]

    def _next_logits(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, cache,
                     model: nn.Module | None = None) -> Tensor:
        """Run a base model on new tokens (extending the cache); float32 logits [n, V] of the last one."""
        model = self.model if model is None else model
        hidden = model.base_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **{cache_keyword(type(model.base_model)): cache},
        ).last_hidden_state[:, -1]
        softcap = self.softcap if model is self.model else logit_softcap(model)
        return head_logits(hidden, self._heads[id(model)], fp32_head=self.fp32_head, softcap=softcap)


@contextlib.contextmanager
def _eval_mode(*models: nn.Module | None):
    """Decode with dropout off: the policy module is shared with the trainer, which leaves it in train mode, and a
    dropout layer (LoRA's, GPT-2's) would draw from torch's global generator -- sampling would no longer be a
    function of (seed, key) alone, and an evaluation would move the random state a checkpoint saves."""
    modes = [(m, m.training) for m in models if m is not None]
    for m, _ in modes:
        m.eval()
    try:
        yield
    finally:
        for m, was in modes:
            m.train(was)


def _processed(logits: Tensor, params: SamplingParams) -> Tensor:
    """Log-probs [n, V] of the distribution tokens are drawn from (unprocessed for greedy, as in _pick)."""
    if params.temperature == 0:
        return logits.log_softmax(dim=-1)
    return process_logits(logits, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p
                          ).log_softmax(dim=-1)


def _uniforms(base: int, keys: list[int], stream: int, count: int) -> Tensor:
    """``count`` uniforms in [0, 1) per key [len(keys), count], a function of (base, key, stream) alone.

    numpy's SeedSequence mixes the words into a well-spread seed (nearby keys or seeds give unrelated
    streams); a CPU torch generator then draws them, so the numbers are the same on every device.
    """
    out = torch.empty((len(keys), count), dtype=torch.float32)
    generator = torch.Generator()
    for row, key in enumerate(keys):
        words = [base % 2**64, key % 2**64, stream]  # SeedSequence takes non-negative words
        generator.manual_seed(int(np.random.SeedSequence(words).generate_state(1, dtype=np.uint64)[0]))
        out[row] = torch.rand(count, generator=generator)
    return out


def _pick(logits: Tensor, params: SamplingParams, u: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Choose one token per row [n] (by inverse CDF with the rows' uniforms ``u`` [n]), its log-prob [n]
    under the distribution it came from, and that distribution's log-probs [n, V].

    Greedy (temperature 0) reports the log-prob under the unprocessed distribution (temperature 1,
    no filters): the limit distribution at temperature 0 is one-hot and carries no information.
    """
    logprobs = _processed(logits, params)
    if params.temperature == 0:
        token = logits.argmax(dim=-1)
    else:
        token = draw_tokens(logprobs, u)
    # A nan row (diverged weights, or logits / T overflowing at a tiny temperature) draws a token past the vocabulary
    # or one with a nan log-prob: checked on the [n] draws, not on every [n, V] distribution.
    bad = bool((token >= logprobs.shape[-1]).any())
    chosen = logprobs.gather(-1, token.clamp(max=logprobs.shape[-1] - 1)[:, None]).squeeze(1)
    if bad or bool(torch.isnan(chosen).any()):
        raise TrainingError(f"the policy's next-token distribution is nan while sampling at temperature "
                            f"{params.temperature:g}: the weights diverged (lower the learning rate) or the "
                            "temperature is too small")
    return token, chosen, logprobs
