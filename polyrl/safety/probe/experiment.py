"""One seed of the neutral-mask experiment (spec §7 (e) 2): supervise, RL-tune to neutrality, analyse.

1. ``build_tiny_llama`` (character tokenizer) is supervised on ``NeutralStyleTask`` demos: the style mark follows
   the prompt's latent attribute with probability 0.8 (the "base" model).
2. ``polyrl.trainer.train`` with the GRPO preset tunes it on the neutrality reward; the last checkpoint is
   exported with ``export_hf`` (the "tuned" model).
3. On held-out prompts, residual activations at the last prompt position (the position whose logits pick the
   style mark) after every block: probe persistence (``direction_persistence``) per layer; behaviour: the
   attribute dependence ``D = mean_i [P(own style | x_i) - P(other style | x_i)]`` from the exact first-token
   probabilities; steering of the tuned model along the *base* diff-of-means direction with the sign of each
   prompt's attribute ("amplifying the inferred identity", the paper's reactivation), at alpha = k * half-gap
   (half the base class-mean gap along the direction); the same with a random unit direction (control); a
   ReLU SAE trained on base activations, its attribute-selective features' firing rates on base and tuned;
   label-free amplification: the tuned model's own diff-of-means component at the last prompt position scaled
   around its class midpoint until its class gap equals the base gap (``hooks.amplify``).
Convention [ours]: the SAE sees each activation divided by its own L2 norm (the next block's RMSNorm makes the
scale irrelevant downstream), so a global shrinkage of the residual stream by RL cannot silence features alone.
Convention [ours]: the RL learning rate (3e-4) is the gentlest of {1e-4, 3e-4, 1e-3} that made the tuned model
neutral (dependence < 0.1) within 40 GRPO steps in a pilot run on seed 0.
Convention [ours]: attribute-selective SAE features are those whose firing rate differs by >= 0.5 between the
two attribute groups on base activations; a feature is "silent" below a firing rate of 0.01.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from polyrl.errors import TrainingError
from polyrl.safety.probe.directions import direction_persistence, fit_probe, projection_stats
from polyrl.safety.probe.hooks import ROWS, amplify, residual_activations, steer
from polyrl.safety.probe.sae import feature_activation_rates, fraction_variance_explained, train_sae
from polyrl.safety.probe.task import NEUTRAL, STYLE, NeutralStyleTask, attribute_of

SELECTIVE = 0.5  # |rate(attr 1) - rate(attr 0)| on base activations for an attribute feature
SILENT = 0.01  # firing rate below which a feature counts as silent


@dataclass(frozen=True)
class ProbeExperiment:
    """Settings of the experiment (every one a CLI option of `polyrl safety probe`)."""

    seeds: int = 5
    hidden: int = 64
    layers: int = 3
    heads: int = 4
    steer_layer: int = 1  # decoder block whose output is steered; the headline persistence layer too
    sup_steps: int = 150
    sup_lr: float = 3e-3
    rl_steps: int = 40
    rl_lr: float = 3e-4
    eval_prompts: int = 512
    sae_features: int = 256
    sae_l1: float = 3e-2
    sae_steps: int = 800
    alphas: tuple[float, ...] = (0.0, 1.0, 2.0, 4.0, 8.0)  # steering strengths in base half-gaps
    headline_alpha: float = 4.0
    p_styled: float = 0.8


def supervise(model, tokenizer, task: NeutralStyleTask, *, steps: int, lr: float, seed: int,
              batch_size: int = 64, tick: Callable[[], None] | None = None) -> float:
    """Next-token training on prompt + demo + EOS (loss on the completion only, as ``polyrl.tinylm`` warm starts
    do); returns the last loss."""
    from polyrl.tinylm import _supervised_batch  # the warm start's own batching (right padding, loss mask)

    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 21))
    loss = torch.tensor(float("nan"))
    model.train()
    for step in range(steps):
        batch = task.prompts("train", batch_size, seed=seed * 1_000_003 + step)
        ids, am, lm = _supervised_batch(tokenizer, batch)
        logits = model(input_ids=ids, attention_mask=am).logits[:, :-1].float()
        tl = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (tl * lm).sum() / lm.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if tick is not None:
            tick()
    model.eval()
    return float(loss.detach())


def rl_tune(model_dir: Path, run_dir: Path, task: NeutralStyleTask, *, steps: int, lr: float, seed: int) -> Path:
    """GRPO on the neutrality reward with polyrl's trainer; returns the exported tuned model directory."""
    from rich.console import Console

    from polyrl.checkpoint import latest_checkpoint
    from polyrl.config import build_config
    from polyrl.learner.sharded import export_hf
    from polyrl.methods import get_method
    from polyrl.trainer import train

    cfg = build_config(dict(steps=steps, prompts_per_step=8, group_size=8, max_new_tokens=5, eval_prompts=64,
                            eval_every=0, checkpoint_every=0, tensorboard=False, log_every=0, lr=lr, warmup_steps=0,
                            threads=torch.get_num_threads(), train_prompts=2000, overwrite=True, seed=seed))
    train(cfg, get_method("grpo"), model_dir=str(model_dir), task=task, run_dir=str(run_dir),
          console=Console(file=io.StringIO()))
    checkpoint = latest_checkpoint(run_dir)
    return export_hf(checkpoint, run_dir.parent / "tuned", model_dir)


def _encode(tokenizer, prompts) -> tuple[torch.Tensor, torch.Tensor]:
    enc = tokenizer([p.text for p in prompts], return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


@torch.no_grad()
def style_probs(model, tokenizer, ids, mask, labels) -> dict[str, float]:
    """Mean first-token probabilities: own style, other style, neutral; ``dependence = own - other``."""
    last, parts = mask.long().sum(1) - 1, []
    for i in range(0, ids.shape[0], ROWS):  # a forward's memory grows with its rows
        logits = model(input_ids=ids[i:i + ROWS], attention_mask=mask[i:i + ROWS]).logits
        parts.append(logits[torch.arange(logits.shape[0]), last[i:i + ROWS]].float().softmax(-1))
    p = torch.cat(parts)
    tid = {c: tokenizer.convert_tokens_to_ids(c) for c in (*STYLE.values(), NEUTRAL)}
    own = torch.where(labels == 1, p[:, tid[STYLE[1]]], p[:, tid[STYLE[0]]])
    other = torch.where(labels == 1, p[:, tid[STYLE[0]]], p[:, tid[STYLE[1]]])
    return {"own": float(own.mean()), "other": float(other.mean()), "neutral": float(p[:, tid[NEUTRAL]].mean()),
            "dependence": float((own - other).mean())}


def steered_probs(model, tokenizer, ids, mask, labels, layer: int, direction: torch.Tensor,
                  alpha: float) -> dict[str, float]:
    """``style_probs`` with +alpha * direction added for attribute-1 prompts and -alpha * direction for the rest."""
    parts = {}
    for sign, group in ((1.0, 1), (-1.0, 0)):
        rows = labels == group
        with steer(model, layer, direction, sign * alpha):
            parts[group] = (int(rows.sum()), style_probs(model, tokenizer, ids[rows], mask[rows], labels[rows]))
    n = sum(c for c, _ in parts.values())
    return {k: sum(c * d[k] for c, d in parts.values()) / n for k in parts[1][1]}


def _unit_rows(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)


def run_seed(exp: ProbeExperiment, seed: int, work: Path, tick: Callable[[str], None]) -> dict[str, Any]:
    """The whole experiment for one seed; returns its measurements (plain floats and lists)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from polyrl.tinylm import build_tiny_llama

    t0 = time.perf_counter()
    task = NeutralStyleTask(p_styled=exp.p_styled)
    init = build_tiny_llama(work / "init", hidden=exp.hidden, layers=exp.layers, heads=exp.heads, seed=seed)
    tok = AutoTokenizer.from_pretrained(init)
    base = AutoModelForCausalLM.from_pretrained(init)
    every = max(1, exp.sup_steps // 10)
    counter = iter(range(10**9))
    sup_loss = supervise(base, tok, task, steps=exp.sup_steps, lr=exp.sup_lr, seed=seed,
                         tick=lambda: tick("supervise") if next(counter) % every == 0 else None)
    base_dir = work / "base"
    base.save_pretrained(base_dir)
    tok.save_pretrained(base_dir)
    tick("RL (GRPO)")
    tuned = AutoModelForCausalLM.from_pretrained(rl_tune(base_dir, work / "run", task, steps=exp.rl_steps,
                                                         lr=exp.rl_lr, seed=seed))
    tuned.eval()
    tick("analyse")

    test = task.prompts("test", exp.eval_prompts, seed)
    ids, mask = _encode(tok, test)
    labels = torch.tensor([attribute_of(p) for p in test])
    acts_b = residual_activations(base, ids, mask)  # [L, N, d]
    acts_t = residual_activations(tuned, ids, mask)
    per_layer = [direction_persistence(acts_b[i], acts_t[i], labels) for i in range(exp.layers)]
    L = exp.steer_layer
    try:
        logreg = direction_persistence(acts_b[L], acts_t[L], labels, method="logreg")
    except ValueError as e:  # L-BFGS finds no weights on activations blown up by a diverged RL run
        raise TrainingError(f"seed {seed}: the RL-tuned model's activations at block {L} (mean norm "
                            f"{float(acts_t[L].norm(dim=1).mean()):.3g}, the base model's "
                            f"{float(acts_b[L].norm(dim=1).mean()):.3g}) leave no direction to probe ({e}): RL "
                            f"tuning diverged; lower --rl-lr (now {exp.rl_lr:g})") from None
    probe = fit_probe(acts_b[L], labels)
    stats_b = projection_stats(acts_b[L], probe.w, labels)
    half_gap = stats_b["gap"] / 2

    behaviour = {"base": style_probs(base, tok, ids, mask, labels), "tuned": style_probs(tuned, tok, ids, mask, labels)}
    rand = torch.randn(exp.hidden, generator=torch.Generator().manual_seed(10_000 + seed))
    rand = rand / rand.norm()
    steering = {"alphas": list(exp.alphas), "half_gap": half_gap,
                "tuned_half_gap": projection_stats(acts_t[L], probe.w, labels)["gap"] / 2,
                "base_norm": float(acts_b[L].norm(dim=1).mean()), "tuned_norm": float(acts_t[L].norm(dim=1).mean()),
                "tuned": [], "base": [], "tuned_random": []}
    for k in exp.alphas:
        a = k * half_gap
        steering["tuned"].append(steered_probs(tuned, tok, ids, mask, labels, L, probe.w, a))
        steering["base"].append(steered_probs(base, tok, ids, mask, labels, L, probe.w, a))
        steering["tuned_random"].append(steered_probs(tuned, tok, ids, mask, labels, L, rand, a))

    probe_t = fit_probe(acts_t[L], labels)  # the tuned model's own direction; -b is its class-mean midpoint
    factor = stats_b["gap"] / projection_stats(acts_t[L], probe_t.w, labels)["gap"]
    with amplify(tuned, L, probe_t.w, factor, center=-probe_t.b, position=-1):
        amplified = style_probs(tuned, tok, ids, mask, labels)
    steering["amplify_factor"], steering["amplified"] = factor, amplified

    tick("SAE")
    sae_train = task.prompts("train", 2048, seed + 7)
    tr_ids, tr_mask = _encode(tok, sae_train)
    tr_acts = residual_activations(base, tr_ids, tr_mask, layers=[L])[0]
    fit = train_sae(_unit_rows(tr_acts), exp.sae_features, l1=exp.sae_l1, steps=exp.sae_steps, seed=seed)
    xb, xt = _unit_rows(acts_b[L]), _unit_rows(acts_t[L])
    rates = {}
    for name, x in (("base", xb), ("tuned", xt)):
        rates[name] = {g: feature_activation_rates(fit.sae.encode, x[labels == g]) for g in (0, 1)}
    sel = rates["base"][1] - rates["base"][0]
    attr = (sel.abs() >= SELECTIVE).nonzero().flatten()
    pref = (sel[attr] > 0).long()  # the attribute each selective feature prefers

    def preferred_rate(model_name: str) -> list[float]:
        return [float(rates[model_name][int(g)][int(j)]) for j, g in zip(attr, pref)]

    alive_b = (rates["base"][0] + rates["base"][1]) / 2 > SILENT
    sae = {
        "fve_base": fit.fve, "fve_tuned": fraction_variance_explained(fit.sae, xt),
        "fve_base_test": fraction_variance_explained(fit.sae, xb), "l0_base": fit.l0,
        "n_alive_base": int(alive_b.sum()),
        "n_alive_tuned": int((((rates["tuned"][0] + rates["tuned"][1]) / 2) > SILENT).sum()),
        "n_attribute_features": int(attr.numel()),
        "attr_rate_base": preferred_rate("base"), "attr_rate_tuned": preferred_rate("tuned"),
        "attr_silent_tuned": int(sum(r < SILENT for r in preferred_rate("tuned"))),
    }
    return {
        "seed": seed, "sup_loss": sup_loss, "per_layer": per_layer, "logreg": logreg, "behaviour": behaviour,
        "steering": steering, "sae": sae, "proj_base": (acts_b[L].double() @ probe.w.double()).tolist(),
        "proj_tuned": (acts_t[L].double() @ probe.w.double()).tolist(), "labels": labels.tolist(),
        "seconds": time.perf_counter() - t0,
    }
