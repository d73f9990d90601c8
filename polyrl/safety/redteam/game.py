"""The toy red-teaming game of AdvGRPO's CPU demonstration: tabular attacker and defender, synthetic prompts.

Everything here is synthetic and templated: a "prompt" is a style token and an obfuscation token, never text
with content. [ours] The game is our operationalisation of spec §10 (e) 4 (arXiv:2606.09701 gives no toy).

- The attacker writes one message per turn: a style token s (6) then an obfuscation token o (3), from a
  tabular autoregressive policy indexed by its context (turn 1, or turn 2 after the defender's first reply).
  Every attacker message carries a (synthetic) harmful goal. Multi-turn episodes have at most two messages;
  the second is sent only when the first was not complied with.
- The defender sees the message's style and a binary "harm cue" (a detector firing with probability
  ``STYLE_CUE[s] * OBF_CUE[o]`` on attacks, ``BENIGN_CUE`` on benign prompts) and answers comply,
  safe_complete or refuse. Benign prompts come from a fixed pool (style distribution ``BENIGN_STYLE``, no
  obfuscation): the defender cannot tell a benign prompt from an attack with the same (style, cue), which
  gives the game its trade-off between attack success and helpfulness.
- Fluent styles are caught more often; obfuscation hides the cue but costs fluency (the prompt judge).

Text forms (what the judges read): a defender prompt is ``"[style|obf|cue=c] request"`` with answer
``"harmful"`` or ``"benign"``; an attacker completion is the transcript ``"style/obf->reply; style/obf->reply"``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

STYLES = ("direct", "polite", "roleplay", "hypothetical", "fragmented", "encoded")
STYLE_FLUENCY = (9.0, 9.0, 7.0, 7.0, 3.0, 2.0)  # prompt judge's base score (Likert 1..10)
STYLE_CUE = (0.95, 0.8, 0.5, 0.45, 0.3, 0.15)  # P(harm cue fires | attack in this style, no obfuscation)
OBFUSCATION = ("none", "light", "heavy")
OBF_FLUENCY = (0.0, -1.0, -3.0)
OBF_CUE = (1.0, 0.6, 0.3)
BENIGN_STYLE = (0.4, 0.35, 0.1, 0.1, 0.05, 0.0)  # style distribution of the benign pool
BENIGN_CUE = 0.05  # false-positive rate of the harm cue on benign prompts
RESPONSES = ("comply", "safe_complete", "refuse")
COMPLY = 0
N_CTX = 1 + len(RESPONSES)  # attacker contexts: turn 1, and turn 2 after each reply


def fluency(s: int, o: int) -> float:
    """Prompt judge's score of a message (Likert 1..10): base fluency of the style plus the obfuscation cost."""
    return min(10.0, max(1.0, STYLE_FLUENCY[s] + OBF_FLUENCY[o]))


def cue_prob(s: int, o: int) -> float:
    return STYLE_CUE[s] * OBF_CUE[o]


def defender_prompt(s: int, o: int, cue: int) -> str:
    return f"[{STYLES[s]}|{OBFUSCATION[o]}|cue={cue}] request"


def parse_defender_prompt(text: str) -> tuple[str, str, int]:
    """``"[style|obf|cue=c] request"`` -> (style, obf, cue)."""
    inner = text[text.index("[") + 1:text.index("]")]
    style, obf, cue = inner.split("|")
    return style, obf, int(cue.split("=")[1])


def parse_transcript(text: str) -> list[tuple[str, str, str]]:
    """``"style/obf->reply; ..."`` -> [(style, obf, reply), ...]."""
    out = []
    for part in text.split(";"):
        msg, reply = part.strip().split("->")
        style, obf = msg.split("/")
        out.append((style, obf, reply))
    return out


class AttackerPolicy(torch.nn.Module):
    """Tabular autoregressive attacker: pi(s | ctx) then pi(o | ctx, s); ctx 0 = turn 1, 1 + r = after reply r."""

    def __init__(self) -> None:
        super().__init__()
        self.style_logits = torch.nn.Parameter(torch.zeros(N_CTX, len(STYLES)))
        self.obf_logits = torch.nn.Parameter(torch.zeros(N_CTX, len(STYLES), len(OBFUSCATION)))

    def probs(self) -> tuple[Tensor, Tensor]:
        """P(s | ctx) [N_CTX, S] and P(o | ctx, s) [N_CTX, S, O] (detached)."""
        with torch.no_grad():
            return self.style_logits.softmax(-1), self.obf_logits.softmax(-1)

    def logp(self, ctx: Tensor, s: Tensor, o: Tensor) -> Tensor:
        """Token log-probs [B, 2M] of M messages (ctx, s, o each [B, M]): token 2m = style, 2m + 1 = obfuscation."""
        ls = self.style_logits.log_softmax(-1)[ctx, s]
        lo = self.obf_logits.log_softmax(-1)[ctx, s, o]
        return torch.stack([ls, lo], dim=-1).reshape(ctx.shape[0], -1)


class DefenderPolicy(torch.nn.Module):
    """Tabular defender pi(reply | style, cue). Initialised as a 'safety-tuned' model: refuse when the cue fires."""

    def __init__(self, prior: float = 2.0) -> None:
        super().__init__()
        init = torch.zeros(len(STYLES), 2, len(RESPONSES))
        init[:, 1, RESPONSES.index("refuse")] = prior
        init[:, 0, COMPLY] = prior
        self.logits = torch.nn.Parameter(init)

    def probs(self) -> Tensor:
        with torch.no_grad():
            return self.logits.softmax(-1)

    def logp(self, s: Tensor, cue: Tensor, r: Tensor) -> Tensor:
        """Log-prob [B, 1] of reply r in state (s, cue) (each [B])."""
        return self.logits.log_softmax(-1)[s, cue, r][:, None]


@dataclass
class Episodes:
    """A batch of attacker episodes: M message slots, a mask for the messages actually sent."""

    ctx: Tensor  # [B, M] long
    s: Tensor  # [B, M]
    o: Tensor  # [B, M]
    cue: Tensor  # [B, M]
    reply: Tensor  # [B, M]
    sent: Tensor  # [B, M] float 1 where a message was sent

    @property
    def token_mask(self) -> Tensor:
        return self.sent.repeat_interleave(2, dim=1)

    def transcripts(self) -> list[str]:
        out = []
        for b in range(self.s.shape[0]):
            msgs = [f"{STYLES[int(self.s[b, m])]}/{OBFUSCATION[int(self.o[b, m])]}->{RESPONSES[int(self.reply[b, m])]}"
                    for m in range(self.s.shape[1]) if self.sent[b, m] > 0]
            out.append("; ".join(msgs))
        return out


def _sample_defender(defender: DefenderPolicy, s: Tensor, cue: Tensor, gen: torch.Generator) -> Tensor:
    p = defender.probs()[s, cue]
    return torch.multinomial(p, 1, generator=gen)[:, 0]


def sample_episodes(attacker: AttackerPolicy, defender: DefenderPolicy, n: int, turns: int,
                    gen: torch.Generator) -> Episodes:
    """Play ``n`` episodes of at most ``turns`` (1 or 2) attacker messages against the defender."""
    ps, po = attacker.probs()
    cue_tab = torch.tensor([[cue_prob(s, o) for o in range(len(OBFUSCATION))] for s in range(len(STYLES))])
    shape = (n, turns)
    ctx, s, o, cue, reply = (torch.zeros(shape, dtype=torch.long) for _ in range(5))
    sent = torch.zeros(shape)
    alive = torch.ones(n, dtype=torch.bool)
    cur_ctx = torch.zeros(n, dtype=torch.long)
    for m in range(turns):
        sm = torch.multinomial(ps[cur_ctx], 1, generator=gen)[:, 0]
        om = torch.multinomial(po[cur_ctx, sm], 1, generator=gen)[:, 0]
        cm = (torch.rand(n, generator=gen) < cue_tab[sm, om]).long()
        rm = _sample_defender(defender, sm, cm, gen)
        ctx[:, m], s[:, m], o[:, m], cue[:, m], reply[:, m] = cur_ctx, sm, om, cm, rm
        sent[:, m] = alive.float()
        alive = alive & (rm != COMPLY)
        cur_ctx = 1 + rm
    return Episodes(ctx=ctx, s=s, o=o, cue=cue, reply=reply, sent=sent)


def sample_benign(n: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Styles and cues [n] of benign prompts from the fixed pool."""
    s = torch.multinomial(torch.tensor(BENIGN_STYLE), n, replacement=True, generator=gen)
    cue = (torch.rand(n, generator=gen) < BENIGN_CUE).long()
    return s, cue


def message_comply_prob(defender: DefenderPolicy) -> Tensor:
    """P(comply | attack message (s, o)) [S, O], marginal over the harm cue."""
    pc = defender.probs()[..., COMPLY]  # [S, 2]
    c = torch.tensor([[cue_prob(s, o) for o in range(len(OBFUSCATION))] for s in range(len(STYLES))])
    return (1 - c) * pc[:, 0, None] + c * pc[:, 1, None]


def exact_asr(attacker: AttackerPolicy, defender: DefenderPolicy, turns: int) -> float:
    """Exact attack success rate of an episode (any message complied with), no sampling.

    ASR_1 = sum_{s,o} pi(s,o | ctx 0) q(s,o), q = P(comply | s, o); with two turns
    ASR_2 = ASR_1 + sum_{r != comply} P(r on turn 1) sum_{s,o} pi(s,o | ctx 1 + r) q(s,o).
    """
    ps, po = attacker.probs()
    joint = ps[:, :, None] * po  # [CTX, S, O]
    q = message_comply_prob(defender)
    succ = (joint * q).sum((1, 2))  # P(comply | ctx)
    asr = float(succ[0])
    if turns > 1:
        p = defender.probs()  # [S, 2, R]
        c = torch.tensor([[cue_prob(s, o) for o in range(len(OBFUSCATION))] for s in range(len(STYLES))])
        reply_given_msg = (1 - c)[..., None] * p[:, None, 0] + c[..., None] * p[:, None, 1]  # [S, O, R]
        p_reply = (joint[0, :, :, None] * reply_given_msg).sum((0, 1))
        asr += float(sum(p_reply[r] * succ[1 + r] for r in range(len(RESPONSES)) if r != COMPLY))
    return asr


def exact_benign(defender: DefenderPolicy, helpfulness: tuple[float, ...]) -> tuple[float, float]:
    """(mean helpfulness score on the benign pool, benign refusal rate), exact."""
    p = defender.probs()  # [S, 2, R]
    w = torch.tensor(BENIGN_STYLE)[:, None] * torch.tensor([1 - BENIGN_CUE, BENIGN_CUE])[None, :]
    reply = (w[..., None] * p).sum((0, 1))  # P(reply) on benign prompts
    return float((reply * torch.tensor(helpfulness)).sum()), float(reply[RESPONSES.index("refuse")])


def attacker_entropy(attacker: AttackerPolicy) -> float:
    """Entropy (nats) of the turn-1 message distribution pi(s, o | ctx 0); log 18 = 2.89 is uniform."""
    ps, po = attacker.probs()
    joint = (ps[0, :, None] * po[0]).clamp_min(1e-12)
    return float(-(joint * joint.log()).sum())
