"""GGRO decoding: entropy-triggered segments, reward-gradient swap scores, embedding-distance nudges (spec §11).

Source: Lin & Zhang, "Gradient-Guided Reward Optimization for Inference-time Alignment", arXiv 2606.09635 (code
``lhk2004/GGRO``, read for the spec; nothing copied). The base LM and the reward model (RM) are frozen and share a
token embedding table ``E`` [V, d]. Decoding goes segment by segment:

1. decode until the next-token entropy ``H(p_t) = -sum_v p_t[v] log p_t[v]`` of the base LM's processed distribution
   reaches ``H*``; that token (a high-uncertainty insertion point) is the segment's last;
2. score prompt + accepted text + segment with the RM through straight-through one-hot tokens ``R(onehot(y) @ E)``
   and take ``g_i = dR/d onehot_i`` [V];
3. the first-order reward change of swapping ``y_i -> v`` is ``g_i[v] - g_i[y_i]``; among the base LM's top-K tokens
   at position i the nudge token ``v_i*`` has the largest score (greedy), its confidence ``c_i`` is the largest
   softmax probability of the scores at temperature ``tau`` (0.1);
4. the nudge becomes a logit bias ``b_i[v] = -w ||e_v - e_{v_i*}||^2``, rescaled to the logits' norm and weighted by
   ``c_i``; the segment is regenerated with it, up to S candidates in all (stop early when one repeats), and the
   candidate with the highest RM score is kept.

Compute is counted, not timed (``Compute``): LM token-forwards (a KV cache assumed: one per prompt token once and
one per generated token, regenerated ones included), RM forward and backward passes with the tokens they cover.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from polyrl.model import process_logits
from polyrl.rollout.generator import Sample, SamplingParams, draw_tokens

RewardOnEmbeds = Callable[[Tensor], Tensor]  # embeds [B, T, d] -> rewards [B]


@dataclass
class Compute:
    """Counted work of one decode (add them with ``+``).

    ``lm_passes``: LM forward calls per row (one prefill per decode plus one per generated token); ``lm_tokens``:
    token-forwards with a KV cache (prompt once, each generated token once); ``rm_forward`` / ``rm_backward``:
    RM passes over one sequence; ``rm_*_tokens``: the tokens those passes cover.
    """

    lm_passes: int = 0
    lm_tokens: int = 0
    rm_forward: int = 0
    rm_forward_tokens: int = 0
    rm_backward: int = 0
    rm_backward_tokens: int = 0

    def __add__(self, other: Compute) -> Compute:
        return Compute(*(a + b for a, b in zip(self.as_tuple(), other.as_tuple())))

    def as_tuple(self) -> tuple[int, ...]:
        return (self.lm_passes, self.lm_tokens, self.rm_forward, self.rm_forward_tokens, self.rm_backward,
                self.rm_backward_tokens)

    def units(self, rm_size: float = 1.0) -> float:
        """Cost in LM token-forward equivalents: ``lm_tokens + rm_size * (rm_fwd_tokens + 2 * rm_bwd_tokens)``.

        Convention (ours): forward FLOPs are proportional to tokens; a backward pass costs twice its forward
        (the usual 2:1 rule); ``rm_size`` is the RM/LM size ratio (1.0: the paper's 8B+8B and 3B+3B pairs).
        """
        return self.lm_tokens + rm_size * (self.rm_forward_tokens + 2 * self.rm_backward_tokens)

    def to_dict(self) -> dict[str, int]:
        names = ("lm_passes", "lm_tokens", "rm_forward", "rm_forward_tokens", "rm_backward", "rm_backward_tokens")
        return dict(zip(names, self.as_tuple()))


def entropy(logits: Tensor) -> Tensor:
    """Shannon entropy in nats of softmax(logits) over the last axis: ``H = -sum_v p[v] log p[v]``.

    Filtered entries (``-inf``) contribute 0 (the limit of ``p log p``). GGRO (arXiv 2606.09635) ends a segment at
    the first token whose entropy reaches the threshold.
    """
    logp = logits.float().log_softmax(dim=-1)
    p = logp.exp()
    return -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(dim=-1)


def swap_gradients(reward_fn_on_embeds: RewardOnEmbeds, token_ids: Tensor, embed: Tensor) -> tuple[Tensor, Tensor]:
    """The RM's reward of ``token_ids`` [T] and its gradient through one-hot tokens ``g = dR/d onehot`` [T, V].

    ``R(x @ E)`` with ``x = onehot(token_ids)`` (straight-through: ``x`` is exactly one-hot, only its gradient is
    used), arXiv 2606.09635 step 2. One RM forward and one backward.
    """
    x = F.one_hot(token_ids.long(), num_classes=embed.shape[0]).to(embed.dtype).requires_grad_(True)
    with torch.enable_grad():
        reward = reward_fn_on_embeds((x @ embed.detach())[None])[0]
        (grad,) = torch.autograd.grad(reward, x)
    return reward.detach(), grad


def first_order_swap_scores(reward_fn_on_embeds: RewardOnEmbeds, token_ids: Tensor, embed: Tensor,
                            top_k_ids: Tensor, positions: Tensor | None = None) -> Tensor:
    """First-order reward change of swapping token i for each candidate: ``s[i, k] = g_i[v_ik] - g_i[y_i]`` [T, K].

    ``g_i = dR/d onehot_i`` from ``swap_gradients`` (arXiv 2606.09635 step 3). For an RM linear in the embeddings,
    ``R = sum_i a . e_{y_i} + c``, this is exactly ``R(y with y_i -> v) - R(y)`` (tested). ``positions`` [T']
    selects the rows of ``token_ids`` that ``top_k_ids`` [T', K] refers to (default: all T).
    """
    _, grad = swap_gradients(reward_fn_on_embeds, token_ids, embed)
    if positions is not None:
        grad, token_ids = grad[positions], token_ids[positions]
    current = grad.gather(1, token_ids.long()[:, None])
    return grad.gather(1, top_k_ids.long()) - current


def embedding_distance_bias(nudge_ids: Tensor, embed: Tensor, weight: float = 1.0,
                            match_logit_norm: Tensor | None = None) -> Tensor:
    """Logit bias ``b_i[v] = -w ||e_v - e_{v_i*}||^2`` [T, V] toward the embedding neighbours of the nudge tokens.

    arXiv 2606.09635 step 5. ``b_i[v_i*] = 0`` is the row maximum, so adding ``b_i`` raises the nudge token's
    probability (strictly, when its embedding differs from every other token's and its probability is below 1).
    ``match_logit_norm`` (logits [T, V]): rescale each row to ``||b_i|| = ||logits_i||`` (then ``w`` multiplies).
    Convention (ours): a row whose bias is all zero (every embedding equal) stays zero.
    """
    e = embed.detach().float()
    target = e[nudge_ids.long()]  # [T, d]
    dist = (e * e).sum(-1)[None, :] - 2 * target @ e.T + (target * target).sum(-1, keepdim=True)
    bias = -dist.clamp_min(0.0)
    if match_logit_norm is not None:
        finite = torch.where(torch.isfinite(match_logit_norm), match_logit_norm, torch.zeros_like(match_logit_norm))
        norm = bias.norm(dim=-1, keepdim=True)
        bias = torch.where(norm > 0, bias * finite.float().norm(dim=-1, keepdim=True) / norm.clamp_min(1e-30), bias)
    return weight * bias


def select_nudges(scores: Tensor, top_k_ids: Tensor, temperature: float = 0.1) -> tuple[Tensor, Tensor]:
    """Greedy nudge token per position ``v_i* = top_k_ids[i, argmax_k s[i, k]]`` [T] and its confidence
    ``c_i = max_k softmax(s[i] / tau)`` [T] (arXiv 2606.09635 step 4, the code's default ``greedy`` selection)."""
    scaled = scores / temperature
    pick = scaled.argmax(dim=-1)
    return top_k_ids.gather(1, pick[:, None]).squeeze(1), scaled.softmax(dim=-1).max(dim=-1).values


def lm_logits(lm, ids: Tensor) -> Tensor:
    """Next-token logits [B, V] of the last position; ``lm(ids)`` returns logits [B, T, V] or an output with
    ``.logits`` (a transformers causal LM)."""
    out = lm(ids)
    out = out.logits if hasattr(out, "logits") else out
    return out[:, -1].float()


def processed_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """The logits tokens are drawn from: temperature/top-k/top-p as ``polyrl.model.process_logits``; raw for
    greedy (as ``HFGenerator``)."""
    if params.temperature == 0:
        return logits
    return process_logits(logits, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)


@torch.no_grad()
def base_decode(lm, prompt_ids: list[int], params: SamplingParams, uniforms: Tensor,
                eos_ids: tuple[int, ...] = ()) -> tuple[list[list[int]], list[list[float]], list[bool], Compute]:
    """Plain decoding of ``uniforms.shape[0]`` rows of one prompt (the best-of-N sampler and the reference for
    GGRO at ``H* = +inf``): tokens, log-probs under the processed distribution, stopped flags, counted compute.

    Row r's token at step t is drawn by inverse CDF with ``uniforms[r, t]`` (``draw_tokens``), greedy at
    temperature 0. Rows decode in one batch; tokens after a row's stop are discarded.
    """
    n, steps = uniforms.shape[0], params.max_new_tokens
    stop = torch.tensor(sorted({*eos_ids, *params.stop_token_ids}), dtype=torch.long)
    ids = torch.tensor(prompt_ids, dtype=torch.long)[None].repeat(n, 1)
    done = torch.zeros(n, dtype=torch.bool)
    tokens: list[list[int]] = [[] for _ in range(n)]
    logps: list[list[float]] = [[] for _ in range(n)]
    for t in range(steps):
        logits = processed_logits(lm_logits(lm, ids), params)
        logp = logits.log_softmax(-1)
        tok = logits.argmax(-1) if params.temperature == 0 else draw_tokens(logp, uniforms[:, t])
        lp = (logits.float().log_softmax(-1) if params.temperature == 0 else logp).gather(1, tok[:, None])[:, 0]
        for r in range(n):
            if not done[r]:
                tokens[r].append(int(tok[r]))
                logps[r].append(float(lp[r]))
        done |= torch.isin(tok, stop)
        if bool(done.all()):
            break
        ids = torch.cat([ids, tok[:, None]], dim=1)
    stopped = [bool(row and row[-1] in stop.tolist()) for row in tokens]
    generated = sum(len(row) for row in tokens)
    return tokens, logps, stopped, Compute(lm_passes=n + generated, lm_tokens=n * len(prompt_ids) + generated)


@dataclass
class _Segment:
    tokens: list[int]
    logps: list[float]
    logits: list[Tensor]  # processed, unbiased logits [V] per position
    stopped: bool
    triggered: bool = False  # ended at a token whose entropy reached H* (an insertion point)


@torch.no_grad()
def _decode_segment(lm, prefix: list[int], start: int, params: SamplingParams, uniforms: Tensor, stop: set[int],
                    entropy_threshold: float, min_tokens: int, bias: Tensor | None, conf: Tensor | None,
                    match_logit_norm: bool, weight: float = 1.0) -> _Segment:
    """Decode from ``prefix`` (completion step ``start``) until a token drawn from a distribution with entropy
    ``>= H*`` (after ``min_tokens``), a stop token or the length cap. ``bias`` [L, V] is added at segment
    position i < L to the processed logits (so filtered tokens stay filtered), scaled per position by
    ``weight * conf[i]`` and, when ``match_logit_norm``, by ``||logits_i|| / ||b_i||`` first (spec 11: rescaled to the
    logit norm, then w multiplies -- rescaling after w would cancel it)."""
    ids = list(prefix)
    seg = _Segment([], [], [], False)
    for step in range(start, params.max_new_tokens):
        logits = processed_logits(lm_logits(lm, torch.tensor(ids)[None])[0], params)
        i = step - start
        drawn = logits
        if bias is not None and i < bias.shape[0]:
            b = bias[i]
            if match_logit_norm:
                finite = torch.where(torch.isfinite(logits), logits, torch.zeros_like(logits))
                bn = b.norm()
                b = b * (finite.norm() / bn) if bn > 0 else b
            drawn = logits + weight * conf[i] * b
        if params.temperature == 0:
            token = int(drawn.argmax())
            logp = float(logits.log_softmax(-1)[token])
        else:
            token = int(draw_tokens(drawn.log_softmax(-1)[None], uniforms[step : step + 1])[0])
            logp = float(logits.log_softmax(-1)[token])
        seg.tokens.append(token)
        seg.logps.append(logp)
        seg.logits.append(logits)
        ids.append(token)
        if token in stop:
            seg.stopped = True
            break
        if len(seg.tokens) >= min_tokens and float(entropy(logits)) >= entropy_threshold:
            seg.triggered = True
            break
    return seg


def ggro_decode(lm, rm: RewardOnEmbeds, prompt_ids: list[int], *, embed: Tensor, entropy_threshold: float,
                num_refinements: int, max_new_tokens: int, top_k: int = 25, nudge_temp: float = 0.1,
                nudge_weight: float = 1.0, seed: int | None = None, params: SamplingParams | None = None,
                uniforms: Tensor | None = None, eos_ids: tuple[int, ...] = (), min_segment_tokens: int = 1,
                match_logit_norm: bool = True) -> dict:
    """GGRO decoding of one prompt (arXiv 2606.09635; steps in the module docstring).

    ``rm(embeds [B, T, d]) -> [B]`` scores prompt + completion from the shared embeddings ``embed`` [V, d].
    Randomness: ``uniforms`` [max_new_tokens] (default drawn from ``seed``); completion step t always uses
    ``uniforms[t]``, in every regeneration (common random numbers), so ``entropy_threshold = +inf`` or
    ``num_refinements = 1`` reproduces ``base_decode`` with the same uniforms exactly.
    Convention (ours): only a segment that ends at an insertion point (entropy >= H*) is refined; one ended by
    a stop token or the length cap first is accepted as drawn (so H* = +inf is the base decode, spec §11e).
    The bias is added to the processed logits at every position of the previous candidate;
    the released code instead forces one position with a 1e7 coefficient. The RM pass of the last allowed
    candidate is a forward only (its gradient would not be used); with S = 1 nothing is scored.
    Returns ids (completion), logprobs (base LM's processed distribution), stopped, reward (RM score of the
    accepted text when its last segment was scored, else None), num_nudges (segments whose kept candidate was
    a nudged one), segment_bounds (completion end index per segment), lm_calls, rm_calls, compute (``Compute``).
    """
    if num_refinements < 1:
        raise ValueError(f"num_refinements must be >= 1, got {num_refinements}")
    params = params or SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0)
    if params.max_new_tokens != max_new_tokens:
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=params.temperature, top_p=params.top_p,
                                top_k=params.top_k, stop_token_ids=params.stop_token_ids)
    if uniforms is None:
        gen = torch.Generator().manual_seed(0 if seed is None else seed)
        uniforms = torch.rand(max_new_tokens, generator=gen)
    stop = {*eos_ids, *params.stop_token_ids}
    completion: list[int] = []
    logps: list[float] = []
    bounds: list[int] = []
    cost = Compute(lm_passes=1, lm_tokens=len(prompt_ids))
    reward, nudges, stopped = None, 0, False
    while len(completion) < max_new_tokens and not stopped:
        start = len(completion)
        prefix = list(prompt_ids) + completion
        best, best_reward, best_index = None, -math.inf, 0
        bias = conf = None
        seen: set[tuple[int, ...]] = set()
        for r in range(num_refinements):
            seg = _decode_segment(lm, prefix, start, params, uniforms, stop, entropy_threshold, min_segment_tokens,
                                  bias, conf, match_logit_norm, nudge_weight)
            cost = cost + Compute(lm_passes=len(seg.tokens), lm_tokens=len(seg.tokens))
            if tuple(seg.tokens) in seen:
                break
            seen.add(tuple(seg.tokens))
            if num_refinements == 1 or (r == 0 and not seg.triggered):
                best = seg  # no insertion point (stop token or length cap first): nothing to refine
                break
            full = torch.tensor(prefix + seg.tokens)
            last = r == num_refinements - 1
            if last:
                with torch.no_grad():
                    score = rm((embed[full])[None])[0]
                cost = cost + Compute(rm_forward=1, rm_forward_tokens=len(full))
            else:
                score, grad = swap_gradients(rm, full, embed)
                cost = cost + Compute(rm_forward=1, rm_forward_tokens=len(full), rm_backward=1,
                                      rm_backward_tokens=len(full))
            if float(score) > best_reward:
                best, best_reward, best_index = seg, float(score), r
            if last:
                break
            logits = torch.stack(seg.logits)  # [L, V]
            k = min(top_k, logits.shape[-1])
            top_ids = logits.topk(k, dim=-1).indices
            pos = torch.arange(len(prefix), len(full))
            g, y = grad[pos], full[pos]
            scores = g.gather(1, top_ids) - g.gather(1, y[:, None])
            nudge_ids, conf = select_nudges(scores, top_ids, nudge_temp)
            bias = embedding_distance_bias(nudge_ids, embed)  # nudge_weight multiplies after the rescaling
        assert best is not None
        reward = best_reward if best_reward > -math.inf else None
        nudges += int(best_index > 0)
        completion += best.tokens
        logps += best.logps
        stopped = best.stopped
        bounds.append(len(completion))
    return {"ids": completion, "logprobs": logps, "stopped": stopped, "reward": reward, "num_nudges": nudges,
            "segment_bounds": bounds, "lm_calls": cost.lm_passes, "rm_calls": cost.rm_forward + cost.rm_backward,
            "compute": cost}


@dataclass
class GGRODecoder:
    """A ``polyrl.rollout.generator.Generator``-compatible GGRO sampler (usable by ``Evaluator``/``EpisodeRunner``).

    ``generate`` / ``generate_ids`` return ``Sample``s whose ``logprobs`` are the tokens' log-probs under the BASE
    LM's processed distribution (temperature/top-k/top-p), not under the nudged distribution they were drawn
    from: training on these samples is OFF-POLICY (the behaviour policy is GGRO, a reward-guided search, whose
    probabilities are not available), so a trainer must treat them as off-policy data. Randomness per row is
    keyed as ``HFGenerator`` (``(params.seed, key)`` -> one uniform per step), so a row reproduces in any batch.
    ``lm(ids [B, T]) -> logits [B, T, V]`` (or ``.logits``); ``rm(embeds [B, T, d]) -> [B]`` on ``embed`` [V, d].
    """

    lm: object
    rm: RewardOnEmbeds
    embed: Tensor
    tokenizer: object
    entropy_threshold: float = 1.5
    num_refinements: int = 8
    top_k: int = 25
    nudge_temp: float = 0.1
    nudge_weight: float = 1.0
    eos_ids: tuple[int, ...] = ()
    compute: Compute = field(default_factory=Compute)  # running total over calls

    def load_weights(self, state_dict: dict[str, Tensor]) -> None:
        """Copy weights into the base LM (strict)."""
        with torch.no_grad():
            self.lm.load_state_dict(state_dict, strict=True)

    def generate(self, prompts: list[str], params: SamplingParams, keys: list[int] | None = None) -> list[Sample]:
        """``params.n`` GGRO completions per prompt text (tokenized with the tokenizer's special tokens)."""
        return self.generate_ids([list(self.tokenizer(p)["input_ids"]) for p in prompts], params, keys)

    def generate_ids(self, prompt_ids: list[list[int]], params: SamplingParams,
                     keys: list[int] | None = None) -> list[Sample]:
        """The same from token ids; samples grouped by prompt (``n`` copies each), one per row key."""
        from polyrl.rollout.hf import TOKENS, _uniforms

        rows = [(i, ids) for i, ids in enumerate(prompt_ids) for _ in range(params.n)]
        keys = list(range(len(rows))) if keys is None else list(keys)
        if len(keys) != len(rows):
            raise ValueError(f"generate_ids: {len(keys)} keys for {len(rows)} rows (one per prompt and copy)")
        base = (torch.randint(0, 2**62, ()).item() if params.seed is None else params.seed)
        uniforms = _uniforms(int(base), keys, TOKENS, params.max_new_tokens)
        eos = tuple(self.eos_ids) or ((self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None
                                      else ())
        out = []
        for (index, ids), u in zip(rows, uniforms):
            res = ggro_decode(self.lm, self.rm, list(ids), embed=self.embed, entropy_threshold=self.entropy_threshold,
                              num_refinements=self.num_refinements, max_new_tokens=params.max_new_tokens,
                              top_k=self.top_k, nudge_temp=self.nudge_temp, nudge_weight=self.nudge_weight,
                              params=params, uniforms=u, eos_ids=eos)
            self.compute = self.compute + res["compute"]
            out.append(Sample(prompt_index=index, prompt_token_ids=list(ids), completion_token_ids=res["ids"],
                              logprobs=res["logprobs"], finish_reason="stop" if res["stopped"] else "length",
                              text=self.tokenizer.decode(res["ids"], skip_special_tokens=True)))
        return out
