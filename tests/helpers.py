"""Shared builders for tests: random LossInputs with every optional field filled."""

from __future__ import annotations

import torch

from polyrl.types import LossInputs, Normalizer, group_token_counts


def lengths_mask(lengths: list[int], T: int, dtype=torch.float64) -> torch.Tensor:
    return (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).to(dtype)


def make_inputs(
    B: int = 6,
    T: int = 7,
    K: int = 4,
    V: int = 12,
    seed: int = 0,
    spread: float = 0.3,
    lengths: list[int] | None = None,
    group_size: int = 3,
    dtype=torch.float64,
    same_policies: bool = False,
) -> LossInputs:
    """Random but valid inputs: policies are real categoricals over V tokens so top-K fields are consistent.

    ``spread`` scales the logit difference between current, old, rollout and reference policies;
    ``same_policies`` makes them identical (ratio exactly 1).
    """
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(B, T, V, generator=g, dtype=dtype)
    s = 0.0 if same_policies else spread

    def policy() -> torch.Tensor:
        return torch.log_softmax(base + s * torch.randn(B, T, V, generator=g, dtype=dtype), -1)

    cur, old, roll, ref = policy(), policy(), policy(), policy()
    if same_policies:
        old = roll = ref = cur
    sampled = torch.multinomial(roll.exp().reshape(-1, V), 1, generator=g).reshape(B, T)  # [B, T], seeded
    # top-K support: column 0 = sampled token, then the rollout policy's most probable others
    masked_roll = roll.scatter(-1, sampled[..., None], -float("inf"))
    others = masked_roll.topk(K - 1, dim=-1).indices
    topk_ids = torch.cat([sampled[..., None], others], -1)
    lengths = lengths or [max(1, T - (i % 3)) for i in range(B)]
    mask = lengths_mask(lengths, T, dtype)
    group_ids = torch.arange(B) // group_size
    # One leaf for the current policy: logp is column 0 of the top-K log-probs, as in the model layer,
    # so gradients through either path reach the same tensor (take grads w.r.t. inp.topk_logp).
    topk_logp = cur.gather(-1, topk_ids).clone().requires_grad_(True)
    logp = topk_logp[..., 0]
    entropy = -(cur.exp() * cur).sum(-1)
    return LossInputs(
        logp=logp,
        old_logp=old.gather(-1, sampled[..., None]).squeeze(-1),
        rollout_logp=roll.gather(-1, sampled[..., None]).squeeze(-1),
        ref_logp=ref.gather(-1, sampled[..., None]).squeeze(-1),
        adv=torch.randn(B, generator=g, dtype=dtype)[:, None].expand(B, T).clone(),
        mask=mask,
        normalizer=Normalizer.from_batch(mask, group_ids, horizon=T),
        entropy=entropy,
        group_ids=group_ids,
        group_tokens=group_token_counts(mask, group_ids),
        segment_ids=(torch.arange(T)[None, :] // 3).expand(B, T).clone(),
        turn_ids=(torch.arange(T)[None, :] // 4).expand(B, T).clone(),
        topk_ids=topk_ids,
        topk_logp=topk_logp,
        old_topk_logp=old.gather(-1, topk_ids),
        rollout_topk_logp=roll.gather(-1, topk_ids),
    )


def cli(capsys, *args: str) -> tuple[int, str]:
    """Exit code and stderr of `polyrl ARGS` run in this process."""
    from polyrl.cli import main

    capsys.readouterr()
    code = main(list(args))
    return code, capsys.readouterr().err


def one_line(err: str, *words: str) -> None:
    """``err`` is one line, no traceback, holding every one of ``words``."""
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)


def step_rows(run) -> list[int]:
    """The step of every row of ``run/metrics.jsonl``."""
    import json

    return [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def tiny_learner(model_dir: str, *, top_k: int = 0):
    """A LocalLearner on ``model_dir`` for ``update_policy`` tests: lr 1e-2, no warm-up or weight decay, one pass of
    up to 8 rows; ``top_k`` its sampling filter."""
    from polyrl.learner.local import LocalLearner
    from polyrl.model import load_policy

    torch.manual_seed(0)
    model, _ = load_policy(model_dir, threads=1)
    return LocalLearner(model, lr=1e-2, weight_decay=0.0, warmup_steps=0, max_grad_norm=10.0, temperature=1.0,
                        top_p=1.0, top_k=top_k, fp32_head=False, micro_batch_size=8)


def random_batch(B: int, P: int, T: int, generator: torch.Generator):
    """A TokenBatch of B rows: P random prompt tokens, T random completion tokens that all count, random rollout
    log-probs."""
    from polyrl.batch import TokenBatch

    comp = torch.ones(B, T)
    return TokenBatch(torch.randint(4, 30, (B, P + T), generator=generator), torch.ones(B, P + T).long(), comp,
                      -torch.rand(B, T, generator=generator), comp.clone(), torch.zeros(B, T, dtype=torch.long))
