"""vLLM sampling backend (GPU, ``pip install 'polyrl[vllm]'``, ``--generator vllm``): the HFGenerator interface on
vLLM's V1 engine. Imported only when that generator is chosen; nothing else in polyrl imports vllm.

Written against vllm 0.33.0 (the version the extra pins) and NOT yet run on a GPU by this repository's CI:

- The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), on the GPU beside the trainer, taking
  ``gpu_memory_utilization`` of its memory. In-process, ``LLM.apply_model(fn)`` calls ``fn`` on the engine's
  ``nn.Module`` directly (nothing is pickled), so ``load_weights`` hands vLLM's own ``model.load_weights`` the
  trainer's tensors: an in-place copy into the engine's parameters after every optimizer step, no restart; the
  prefix cache (KV blocks computed with the old weights) is then reset.
- ``logprobs_mode="processed_logprobs"``: the reported log-prob of a sampled token is under the distribution it
  was drawn from (after temperature, top-k, top-p), as HFGenerator's and as ``completion_logprobs`` recomputes
  them. Greedy requests (temperature 0) report the unprocessed log-softmax, as HFGenerator does.
- Every row (one completion) is a request with ``n = 1`` and its own seed, derived from ``(params.seed, key)``
  as HFGenerator derives its uniforms: a row's draws do not depend on the rows beside it. They are vLLM's draws,
  not HFGenerator's, so the two backends give different completions for the same seed; and vLLM's kernels are
  not batch-invariant, so a row's logits (hence rare draws) may still change with the batch.
- LoRA: the learner's ``weights()`` returns the MERGED weights under the base model's parameter names, so the
  engine always serves a plain model and loads the full merged weights every step (no vLLM LoRA adapters).
- The engine's log-probs differ from the trainer's recomputation (other kernels, a bfloat16 LM head where the
  trainer may use float32): ``--generator vllm`` adds the TIS correction unless ``--correction`` is given, and
  the trainer logs ``rollout/logp_mismatch``.
"""

from __future__ import annotations

import os
import secrets

import numpy as np
from torch import Tensor

from polyrl.rollout.generator import Sample, SamplingParams, check_prompts_fit, eos_token_ids

TOKENS = 0  # HFGenerator's stream index of the token draws: the seed of a row is derived as its uniforms are


def row_seed(base: int, key: int) -> int:
    """The vLLM request seed of a row: a well-mixed 63-bit function of ``(base, key)`` alone."""
    words = [base % 2**64, key % 2**64, TOKENS]
    return int(np.random.SeedSequence(words).generate_state(1, dtype=np.uint64)[0]) >> 1


def engine_eos_ids(model_config, tokenizer) -> list[int]:
    """The tokens that end a completion, as HFGenerator's: the generation config's EOS (transformers falls back to
    the model config's text EOS when the directory has no generation config) and the tokenizer's. A composite
    config (Gemma 3, Qwen2.5-VL, Llava) keeps its EOS on the text config: the top config has no such attribute."""
    generation = model_config.try_get_generation_config().get("eos_token_id")
    if generation is None:
        generation = getattr(model_config.hf_text_config, "eos_token_id", None)
    return eos_token_ids(generation, tokenizer, "VLLMGenerator")


class VLLMGenerator:
    """Sample completions with a vLLM engine built from a local model directory (the run's starting weights)."""

    def __init__(self, model_dir: str, tokenizer, *, dtype: str = "bfloat16", gpu_memory_utilization: float = 0.3,
                 seed: int = 0, max_model_len: int | None = None) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine: apply_model reaches the module
        from vllm import LLM

        self.tokenizer = tokenizer
        # -1: vLLM fits the context to the KV-cache memory it has (a fixed length it cannot hold stops its start);
        # check_prompts_fit then refuses a prompt the length it chose cannot take.
        self.llm = LLM(model=str(model_dir), tokenizer=str(model_dir), dtype=dtype, seed=seed,
                       gpu_memory_utilization=gpu_memory_utilization, logprobs_mode="processed_logprobs",
                       max_model_len=-1 if max_model_len is None else max_model_len)
        self.eos_ids = engine_eos_ids(self.llm.llm_engine.model_config, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.arbiter = None  # agency transfer is HFGenerator's alone (refused with --generator vllm)

    def load_weights(self, state_dict: dict[str, Tensor]) -> None:
        """Copy the trainer's weights (HF names) into the engine's parameters in place, then drop stale KV blocks."""
        weights = list(state_dict.items())
        self.llm.apply_model(lambda model: model.load_weights(weights))
        if not self.llm.reset_prefix_cache():  # False: blocks of the old weights would be reused
            raise RuntimeError("vLLM could not reset its prefix cache after a weight load")

    def generate(self, prompts: list[str], params: SamplingParams, keys: list[int] | None = None) -> list[Sample]:
        """Sample ``params.n`` completions per prompt (plain texts), grouped by prompt."""
        from polyrl.tasks.chat import prompt_ids

        return self.generate_ids(prompt_ids(self.tokenizer, list(prompts)), params, keys)

    def generate_ids(self, prompt_ids: list[list[int]], params: SamplingParams,
                     keys: list[int] | None = None) -> list[Sample]:
        """The same from token ids; ``keys`` as in HFGenerator (one per row, default ``i * n + j``)."""
        from vllm import SamplingParams as EngineParams

        for index, ids in enumerate(prompt_ids):
            if not ids:
                raise ValueError(f"prompt {index} tokenizes to no tokens; nothing to condition on")
        check_prompts_fit(prompt_ids, params.max_new_tokens, self.llm.llm_engine.model_config.max_model_len,
                          self.tokenizer)  # vLLM refuses these too, in a longer message
        rows = [(index, list(ids)) for index, ids in enumerate(prompt_ids) for _ in range(params.n)]
        keys = list(range(len(rows))) if keys is None else list(keys)
        if len(keys) != len(rows):
            raise ValueError(f"generate_ids: {len(keys)} keys for {len(rows)} rows (one per prompt and copy)")
        if not rows:
            return []
        base = secrets.randbits(64) if params.seed is None else params.seed
        stops = sorted({*self.eos_ids, *params.stop_token_ids})
        requests = [EngineParams(n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or 0,
                                 max_tokens=params.max_new_tokens, seed=row_seed(base, key), logprobs=0,
                                 stop_token_ids=stops, detokenize=False) for key in keys]
        outputs = self.llm.generate([{"prompt_token_ids": ids} for _, ids in rows], requests, use_tqdm=False)
        completions = [out.outputs[0] for out in outputs]
        texts = self.tokenizer.batch_decode([list(c.token_ids) for c in completions], skip_special_tokens=True)
        samples = []
        for (index, ids), c, text in zip(rows, completions, texts):
            tokens = list(c.token_ids)
            if c.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM finished a request with {c.finish_reason!r} (expected stop or length)")
            logprobs = [step[token].logprob for step, token in zip(c.logprobs, tokens)]
            samples.append(Sample(prompt_index=index, prompt_token_ids=ids, completion_token_ids=tokens,
                                  logprobs=logprobs, finish_reason=c.finish_reason, text=text))
        return samples
