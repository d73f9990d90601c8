"""Offline preference pairs as a rollout source: TRL's {"prompt", "chosen", "rejected"} rows, no generation.

Each step takes the next ``pairs_per_step`` rows of a seeded order (reshuffled every pass over the file; the
position alone fixes the data, so a resume is exact) and returns them as groups of two: the chosen completion
(score 1) then the rejected one (score 0), shaped by the method's shapers. The prompt is put to the model as the
run puts every prompt (``tasks.chat``: plain text or the chat template) and tokenised with ``prompt_ids``; a
completion is the tokens that ``prompt + completion`` adds to the prompt's, followed by the tokenizer's EOS (as
TRL's DPOTrainer appends it; a completion sampled by the policy ends with it too). A completion is never
truncated (``max_new_tokens`` caps generation only). Offline rows have no rollout log-probs: ``Sample.logprobs``
are 0, which is why the builder refuses corrections and ``anchor='rollout'`` with this source.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from polyrl.errors import ConfigError
from polyrl.objectives import Method
from polyrl.rollout.collect import RolloutBatch
from polyrl.rollout.generator import Sample
from polyrl.rollout.preference_data import PreferenceRow
from polyrl.rollout.score import shape
from polyrl.rollout.source import PromptStream
from polyrl.tasks.base import Prompt
from polyrl.tasks.chat import own_unk_id, prompt_ids, unknown_characters


class PreferenceSource:
    """Groups of (chosen, rejected) from preference rows; implements ``rollout.source.RolloutSource``."""

    def __init__(self, rows: list[PreferenceRow], tokenizer, put: Callable[[Prompt], Prompt], *,
                 pairs_per_step: int, seed: int, max_new_tokens: int, context: int | None = None) -> None:
        """``put`` renders a prompt as the run does (``tasks.chat.PromptFormat.apply``); a row longer than ``context``
        (a learned position table, ``model.context_length``) is refused here, before any step."""
        self.rows, self.tokenizer, self.put, self.context = rows, tokenizer, put, context
        # every row before the first step (hours in, an --overwrite had deleted the old run)
        prompts = [put(Prompt(id=f"preference/{i}", text=r.prompt, answer="")) for i, r in enumerate(rows)]
        eos, unk = int(tokenizer.eos_token_id is not None), own_unk_id(tokenizer)
        encoded = {name: prompt_ids(tokenizer, prompts, [getattr(r, name) for r in rows])
                   for name in ("chosen", "rejected")}
        for i, row in enumerate(rows):
            for name in ("chosen", "rejected"):
                ids = encoded[name][i]
                self._check_length(row, name, len(ids) + eos)
                if unk is not None and unk in ids:  # a character tokenizer reads what it lacks as <unk>
                    chars = unknown_characters(tokenizer, unk, row.prompt + getattr(row, name))
                    raise ConfigError(f"preference_file row {row.line}: its prompt or {name} completion holds "
                                      f"characters the tokenizer has no token for ({', '.join(map(repr, chars[:8]))}), "
                                      f"which it would read as {tokenizer.unk_token}; drop the row or use a model "
                                      "whose tokenizer covers them")
            if encoded["chosen"][i] == encoded["rejected"][i]:
                raise ConfigError(f"preference_file row {row.line}: chosen and rejected are the same tokens for "
                                  "this tokenizer, a pair with nothing to prefer; drop the row")
        self.pairs_per_step, self.seed, self.max_new_tokens = pairs_per_step, seed, max_new_tokens
        self.pos = 0  # rows taken so far
        self._order: tuple[int, Tensor] | None = None  # (pass, permutation) cache

    def _check_length(self, row: PreferenceRow, name: str, tokens: int) -> None:
        if self.context is not None and tokens > self.context:
            raise ConfigError(f"preference_file row {row.line}: the prompt and its {name} completion are {tokens} "
                              f"tokens, beyond the model's position table of {self.context} (max_position_embeddings); "
                              "shorten or drop the row")

    def _row(self, pos: int) -> int:
        n = len(self.rows)
        epoch = pos // n
        if self._order is None or self._order[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = (epoch, torch.randperm(n, generator=gen))
        return int(self._order[1][pos % n])

    def _samples(self, index: int, k: int) -> tuple[Prompt, list[Sample]]:
        row = self.rows[index]
        prompt = self.put(Prompt(id=f"preference/{index}", text=row.prompt, answer=""))
        head = prompt_ids(self.tokenizer, [prompt])[0]
        eos = self.tokenizer.eos_token_id
        out = []
        for name, text in (("chosen", row.chosen), ("rejected", row.rejected)):
            full = prompt_ids(self.tokenizer, [prompt], [text])[0]
            if full[:len(head)] == head:
                ids = full[len(head):]
            else:  # the tokenizer merged across the boundary: encode the completion on its own
                ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            ids = ids + ([eos] if eos is not None else [])
            self._check_length(row, name, len(head) + len(ids))
            out.append(Sample(prompt_index=k, prompt_token_ids=list(head), completion_token_ids=ids,
                              logprobs=[0.0] * len(ids), finish_reason="stop", text=text))
        return prompt, out

    def collect(self, method: Method, stream: PromptStream, step: int) -> RolloutBatch:
        picked = [self._row(self.pos + j) for j in range(self.pairs_per_step)]
        self.pos += self.pairs_per_step
        prompts: list[Prompt] = []
        samples: list[Sample] = []
        for k, index in enumerate(picked):
            prompt, pair = self._samples(index, k)
            prompts += [prompt, prompt]
            samples += pair
        B = len(samples)
        scores = torch.tensor([1.0, 0.0] * len(picked))
        lengths = torch.tensor([len(s.completion_token_ids) for s in samples])
        truncated = torch.zeros(B, dtype=torch.bool)
        stats = {"rollout/gen_rounds": 0.0, "rollout/generated": 0.0, "rollout/groups": float(len(picked)),
                 "rollout/utilization": 1.0, "rollout/mixed_group_frac": 1.0,
                 "rollout/preference_epoch": self.pos / len(self.rows)}
        start = self.pos - len(picked)  # a group's id is its position in the stream: unique even when a row repeats
        return RolloutBatch(group_ids=torch.arange(start, self.pos).repeat_interleave(2), prompts=prompts,
                            samples=samples, scores=scores,
                            rewards=shape(method, scores, lengths, truncated, self.max_new_tokens),
                            keep=torch.ones(B, dtype=torch.bool), truncated=truncated, lengths=lengths, stats=stats)

    def after_update(self, weights: Callable[[], dict[str, Tensor]], version: int) -> None:
        """Nothing samples with the weights: the rows are fixed."""

    def state_dict(self) -> dict[str, Any]:
        return {"preference_pos": self.pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pos = int(state.get("preference_pos", 0))

    def close(self) -> None:
        """Nothing to stop."""
