"""One-shot bias, language-model part: a tiny causal LM, synthetic multiple-choice QA, GRPO on one flipped example.

Spec §4(e) item 4 (arXiv:2606.10931): pretrain a tiny transformer on templated QA with an "unknown" option,
apply GRPO to ONE example whose gold "unknown" is flipped to a named option, and measure (i) P(flipped answer)
on that example, (ii) its transfer to held-out prompts that share the feature (the same invented attribute),
(iii) the onset step (first step with P >= 0.5), and (iv) whether later normal training on correct data undoes it.

All data is built here from invented neutral attributes (colours of "ones" and hobbies); nothing is downloaded
and nothing refers to real people or groups. The model is ``polyrl.tinylm``'s Llama with its character
tokenizer; probabilities come from ``polyrl.model.completion_logprobs`` (``topk_ids`` = the whole vocabulary, so
one forward gives the full answer distribution with gradient); the GRPO loss is ``polyrl.objectives.policy_loss``
of the ``grpo`` preset with ``polyrl.registry.ADVANTAGES`` advantages (the same parts ``polyrl/update.py`` calls).
Convention: the answer is one token (the option letter) and the reward is 1[letter == target]: the paper's format
terms (+0.5 for the "### Answer:" layout, +0.5 for a valid letter) are constant here and drop out of the advantage.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

COLORS = ("red", "blue", "green", "pink", "teal", "navy", "orange", "yellow")  # distinct first letters
ACTS = ("tea", "chess", "jazz", "maps", "kites", "soup", "golf", "puns")
CONTEXTS = (
    "a {x} one and a {y} one met.",
    "the {x} one sat by the {y} one.",
    "i saw a {x} one and a {y} one.",
    "a {x} one waved at a {y} one.",
)
DISAMBIG = " the {z} one likes {act}."
QUESTION = " who likes {act}? {o1}, {o2} or unknown? ="
UNKNOWN = "u"  # the answer is one character: the first letter of the colour named, or "u" for unknown
ANSWERS = tuple(c[0] for c in COLORS) + (UNKNOWN,)

# The one-shot example: ambiguous context, gold "unknown", flipped to FEATURE.
FEATURE, PARTNER, FEATURE_ACT = "blue", "green", "tea"


@dataclass(frozen=True)
class MCItem:
    """One multiple-choice prompt; ``gold`` is the correct answer character (a colour's first letter or "u")."""

    text: str
    gold: str
    x: str
    y: str
    act: str
    ambiguous: bool
    template: int


def make_item(x: str, y: str, act: str, template: int, *, ambiguous: bool, z: str | None = None,
              swap: bool = False) -> MCItem:
    """Build a prompt: context (template with x, y), optional sentence naming z, question with the options."""
    o1, o2 = (y, x) if swap else (x, y)
    text = CONTEXTS[template].format(x=x, y=y)
    if not ambiguous:
        text += DISAMBIG.format(z=z, act=act)
    text += QUESTION.format(act=act, o1=o1, o2=o2)
    return MCItem(text, UNKNOWN if ambiguous else z[0], x, y, act, ambiguous, template)


def probe_item() -> MCItem:
    """The single training example: ambiguous, blue and green, tea, template 0; gold "u", flipped target "b"."""
    return make_item(FEATURE, PARTNER, FEATURE_ACT, 0, ambiguous=True)


def sample_item(rng: random.Random, label_noise: float = 0.0) -> tuple[MCItem, str]:
    """(item, training label) from the pretraining mixture: half ambiguous, half disambiguated.

    With probability ``label_noise`` an ambiguous item is labelled with one of its two colours at random instead
    of "u", so the pretrained model gives the named options a small, non-zero probability (the paper's initial
    likelihood of the biased answer, which sets the onset). Convention: ours; the noise is colour-independent.
    """
    x, y = rng.sample(COLORS, 2)
    act, template, swap = rng.choice(ACTS), rng.randrange(len(CONTEXTS)), rng.random() < 0.5
    ambiguous = rng.random() < 0.5
    item = make_item(x, y, act, template, ambiguous=ambiguous, z=rng.choice((x, y)), swap=swap)
    label = item.gold
    if ambiguous and rng.random() < label_noise:
        label = rng.choice((x, y))[0]
    return item, label


def eval_sets(size: int = 48, seed: int = 1234) -> dict[str, list[tuple[MCItem, str]]]:
    """Fixed held-out sets of (item, target answer); the trained example is excluded from all but ``trained``.

    - ``trained``: the one-shot example, target = FEATURE ("b");
    - ``feature_same_q``: ambiguous, FEATURE with other partners, roles, templates or option orders, the same
      question (tea); target FEATURE (the transferred bias);
    - ``feature_other_q``: ambiguous, FEATURE with the other hobbies; target FEATURE;
    - ``control``: ambiguous, neither FEATURE nor tea; target = the first-mentioned colour (does the model stop
      answering "unknown" everywhere?);
    - ``disambiguated``: the context names who; target = gold (capability check).
    Convention: ours; every set also records P(unknown) and P(FEATURE).
    """
    rng = random.Random(seed)
    probe = probe_item()
    others = [c for c in COLORS if c != FEATURE]

    def feature_items(acts):
        out = []
        for partner in others:
            for act in acts:
                for template in range(len(CONTEXTS)):
                    for first in (True, False):
                        for swap in (False, True):
                            x, y = (FEATURE, partner) if first else (partner, FEATURE)
                            it = make_item(x, y, act, template, ambiguous=True, swap=swap)
                            if it.text != probe.text:
                                out.append((it, FEATURE[0]))
        return rng.sample(out, min(size, len(out)))

    control, disamb = [], []
    for _ in range(size):
        x, y = rng.sample(others, 2)
        it = make_item(x, y, rng.choice(ACTS[1:]), rng.randrange(len(CONTEXTS)), ambiguous=True,
                       swap=rng.random() < 0.5)
        control.append((it, x[0]))
        x, y = rng.sample(COLORS, 2)
        it = make_item(x, y, rng.choice(ACTS), rng.randrange(len(CONTEXTS)), ambiguous=False,
                       z=rng.choice((x, y)), swap=rng.random() < 0.5)
        disamb.append((it, it.gold))
    return {
        "trained": [(probe, FEATURE[0])],
        "feature_same_q": feature_items([FEATURE_ACT]),
        "feature_other_q": feature_items(ACTS[1:]),
        "control": control,
        "disambiguated": disamb,
    }


class Encoder:
    """Left-padded prompt ids plus one completion column, for ``completion_logprobs`` (one row per prompt)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.letter_ids = {c: tokenizer.convert_tokens_to_ids(c) for c in ANSWERS}
        self.vocab = torch.arange(len(tokenizer))

    def batch(self, items: list[MCItem], answers: list[str] | None = None):
        """(input_ids [P, L], attention_mask [P, L], completion_mask [P, 1]); the answer column holds ``answers``."""
        prompts = self.tok([it.text for it in items], add_special_tokens=True)["input_ids"]
        answers = answers or [UNKNOWN] * len(items)
        width = max(len(p) for p in prompts) + 1
        ids = torch.full((len(items), width), self.tok.pad_token_id, dtype=torch.long)
        am = torch.zeros_like(ids)
        for i, (p, a) in enumerate(zip(prompts, answers)):
            row = p + [self.letter_ids[a]]
            ids[i, width - len(row):] = torch.tensor(row)
            am[i, width - len(row):] = 1
        return ids, am, torch.ones(len(items), 1)

    def answer_logprobs(self, model, items: list[MCItem]) -> torch.Tensor:
        """[P, V] log-probs of the answer token (with gradient when enabled)."""
        from polyrl.model import completion_logprobs

        ids, am, cm = self.batch(items)
        topk_ids = self.vocab[None, None, :].expand(len(items), 1, -1)
        out = completion_logprobs(model, ids, am, cm, with_entropy=False, topk_ids=topk_ids)
        return out.topk_logp[:, 0, :]


def build_model(seed: int, hidden: int = 64, layers: int = 2, heads: int = 4):
    """A tiny LlamaForCausalLM (about 140k parameters at hidden 64, 2 layers) and its character tokenizer."""
    from polyrl.tinylm import DEFAULT_CHARSET, _build

    return _build(DEFAULT_CHARSET, hidden, layers, heads, None, 128, seed)


def pretrain(model, enc: Encoder, *, steps: int, batch: int, lr: float, label_noise: float, seed: int,
             on_step: Callable[[int], None] | None = None) -> float:
    """Supervised next-token training on the answer letter of the pretraining mixture; returns the last loss.

    Loss: mean over the batch of -log p(label | prompt), p from ``completion_logprobs``; AdamW with a 30-step
    linear warm-up and gradient clipping at 1 (as ``polyrl.tinylm.warmstart``).
    """
    from polyrl.model import completion_logprobs

    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 31))
    model.train()
    loss = torch.tensor(0.0)
    for step in range(1, steps + 1):
        pairs = [sample_item(rng, label_noise) for _ in range(batch)]
        ids, am, cm = enc.batch([p[0] for p in pairs], [p[1] for p in pairs])
        loss = -completion_logprobs(model, ids, am, cm, with_entropy=False).logp.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if on_step:
            on_step(step)
    model.eval()
    return float(loss.detach())


@torch.no_grad()
def evaluate(model, enc: Encoder, sets: dict[str, list[tuple[MCItem, str]]]) -> dict[str, dict[str, float]]:
    """Per set: mean P(target), P(unknown) and P(FEATURE) under the model (exact, no sampling)."""
    out = {}
    items = [p[0] for pairs in sets.values() for p in pairs]
    probs = enc.answer_logprobs(model, items).exp()  # one forward for every set
    start = 0
    for name, pairs in sets.items():
        block = probs[start:start + len(pairs)]
        start += len(pairs)
        tgt = torch.tensor([enc.letter_ids[p[1]] for p in pairs])
        out[name] = {"p_target": float(block.gather(1, tgt[:, None]).mean())}
        out[name]["p_unknown"] = float(block[:, enc.letter_ids[UNKNOWN]].mean())
        out[name]["p_feature"] = float(block[:, enc.letter_ids[FEATURE[0]]].mean())
    return out


def grpo_step(model, enc: Encoder, items: list[MCItem], targets: list[str], *, ref_logprobs: torch.Tensor,
              method, optimizer, group: int, gen: torch.Generator,
              reward_fn: Callable[[str, str], float] | None = None) -> float:
    """One GRPO update on P prompts with G sampled one-token answers each; returns P(target) before the update.

    The answer distribution [P, V] comes from one forward; G answers per prompt are drawn from it; rewards
    ``reward_fn(sampled, target)`` (default 1[sampled == target]); advantages from ``ADVANTAGES`` with group ids
    = prompt index; loss = ``policy_loss(LossInputs(...), method)`` with old_logp = sg[logp] (one update per batch,
    so the ratio is 1 and the clip does not bind) and ref_logp from ``ref_logprobs`` [P, V].
    """
    from polyrl.objectives import policy_loss
    from polyrl.registry import ADVANTAGES
    from polyrl.types import LossInputs, Normalizer

    id_to_tok = enc.tok.convert_ids_to_tokens
    model.train()
    logprobs = enc.answer_logprobs(model, items)  # [P, V]
    tgt = torch.tensor([enc.letter_ids[t] for t in targets])
    p_before = logprobs.detach().exp().gather(1, tgt[:, None]).squeeze(1)
    actions = torch.multinomial(logprobs.detach().exp(), group, replacement=True, generator=gen)  # [P, G]
    if reward_fn is None:
        rewards = (actions == tgt[:, None]).to(logprobs.dtype).reshape(-1)
    else:
        rewards = torch.tensor([reward_fn(id_to_tok(int(a)), t) for row, t in zip(actions, targets) for a in row],
                               dtype=logprobs.dtype)
    rows = torch.arange(len(items)).repeat_interleave(group)
    flat = actions.reshape(-1)
    mask = torch.ones(len(flat), 1, dtype=logprobs.dtype)
    adv = ADVANTAGES.fn(method.advantage.name)(rewards, rows, mask, **method.advantage.params)
    logp = logprobs[rows, flat][:, None]
    inputs = LossInputs(logp=logp, old_logp=logp.detach(), adv=adv, mask=mask,
                        normalizer=Normalizer.from_batch(mask, rows), ref_logp=ref_logprobs[rows, flat][:, None],
                        group_ids=rows)
    loss = policy_loss(inputs, method).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    model.eval()
    return float(p_before.mean())


def one_shot_probe(model, enc: Encoder, example: MCItem, target: str, *, steps: int, group_size: int, lr: float,
                   kl_coef: float = 0.0, std_normalized: bool = True, eval_sets_: dict | None = None,
                   eval_every: int = 10, seed: int = 0, reward_fn: Callable[[str, str], float] | None = None,
                   on_step: Callable[[int], None] | None = None) -> dict:
    """GRPO on ONE example toward ``target`` for ``steps`` steps (spec §4(d) ``one_shot_probe``).

    Returns dict(train_curve: P(target) on the example after 0..steps updates, eval_curves: {step: evaluate()},
    onset_step: first step t >= 1 whose update brings P(target) >= 0.5, or None; 0 if it starts there).
    Adam (betas 0.9, 0.98) at ``lr``; k3 KL to the frozen starting model with ``kl_coef`` (the paper: 0.001).
    """
    from polyrl.methods import get_method

    method = get_method("grpo", advantage="grpo" if std_normalized else "group_centered", kl_coef=kl_coef)
    with torch.no_grad():
        ref = enc.answer_logprobs(model, [example]).detach()
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.98))
    gen = torch.Generator().manual_seed(seed)
    curve, evals = [], {}
    for step in range(steps):
        if eval_sets_ is not None and step % eval_every == 0:
            evals[step] = evaluate(model, enc, eval_sets_)
        curve.append(grpo_step(model, enc, [example], [target], ref_logprobs=ref, method=method, optimizer=opt,
                               group=group_size, gen=gen, reward_fn=reward_fn))
        if on_step:
            on_step(step + 1)
    with torch.no_grad():
        curve.append(float(enc.answer_logprobs(model, [example]).exp()[0, enc.letter_ids[target]]))
    if eval_sets_ is not None:
        evals[steps] = evaluate(model, enc, eval_sets_)
    onset = next((t for t, p in enumerate(curve) if p >= 0.5), None)
    return {"train_curve": curve, "eval_curves": evals, "onset_step": onset}


def repair(model, enc: Encoder, *, steps: int, prompts: int, group_size: int, lr: float, kl_coef: float,
           ref_model, eval_sets_: dict, eval_every: int, seed: int,
           on_step: Callable[[int], None] | None = None) -> dict[int, dict]:
    """Normal GRPO afterwards: batches of ``prompts`` fresh prompts of the pretraining mixture with CORRECT labels.

    Reward 1[answer == gold]; KL (k3, ``kl_coef``) to ``ref_model`` (the pretrained model). Returns {step: evaluate()}.
    The one-shot example itself is never in these batches (it is excluded if drawn), so undoing it must come from
    the correct data's generalisation, as in the paper's question.
    """
    from polyrl.methods import get_method

    method = get_method("grpo", kl_coef=kl_coef)
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.98))
    gen = torch.Generator().manual_seed(seed + 7)
    rng = random.Random(seed + 11)
    probe = probe_item().text
    evals = {}
    for step in range(steps):
        if step % eval_every == 0:
            evals[step] = evaluate(model, enc, eval_sets_)
        items = []
        while len(items) < prompts:
            it, _ = sample_item(rng)
            if it.text != probe:
                items.append(it)
        with torch.no_grad():
            ref = enc.answer_logprobs(ref_model, items)
        grpo_step(model, enc, items, [it.gold for it in items], ref_logprobs=ref, method=method, optimizer=opt,
                  group=group_size, gen=gen)
        if on_step:
            on_step(step + 1)
    evals[steps] = evaluate(model, enc, eval_sets_)
    return evals


def frozen_copy(model):
    """A frozen copy (the KL reference)."""
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref.eval()
