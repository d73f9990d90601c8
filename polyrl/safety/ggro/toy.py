"""The toy world of the GGRO experiment: a synthetic grammar, a tiny LM, and a proxy RM sharing its embeddings.

Everything is synthetic and built locally (no downloads, no real text). Tokens are the letters a..t of
``polyrl.tinylm.build_char_tokenizer`` (ids 4..23; <bos> 1, <eos> 2), each letter standing for a "word".

- Grammar (ground truth): a first-order Markov chain. Each letter is either near-deterministic (one successor at
  0.9) or branching (5 successors, Dirichlet(1) weights), so the LM's entropy is low at some positions and high
  at others, which is what GGRO's segmentation keys on. After 8 tokens a sentence ends with probability 0.12 per step.
- True reward (held out): ``sum_t u[y_t] - 2 * #(ungrammatical bigrams)`` with ``u = +1`` on 4 letters, ``-1`` on
  4 others, 0 elsewhere; a bigram is ungrammatical when the grammar gives it probability 0.
- Proxy RM: a small conv net on the LM's (frozen, shared) embedding table, fitted by least squares to the true
  reward of grammatical samples only, so it never sees the ungrammatical penalty: a reward-hacking probe.
- Tiny LM: a 2-layer causal transformer (d = 32, tied embeddings) fitted to grammar samples.
Convention (ours): every size here is chosen for a 2-core CPU budget, not taken from the paper.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

LETTERS = "abcdefghijklmnopqrst"
OFFSET, BOS, EOS, PAD = 4, 1, 2, 0  # build_char_tokenizer: <pad> 0, <bos> 1, <eos> 2, <unk> 3
VOCAB = OFFSET + len(LETTERS)


class World:
    """Grammar and true reward of one seed (see the module docstring)."""

    def __init__(self, seed: int, *, min_len: int = 8, stop_prob: float = 0.12) -> None:
        rng = np.random.default_rng(seed)
        n = len(LETTERS)
        self.trans = np.zeros((n, n))
        for a in range(n):
            succ = rng.choice(n, size=5, replace=False)
            if rng.random() < 0.5:
                self.trans[a, succ] = [0.9, 0.04, 0.03, 0.02, 0.01]
            else:
                self.trans[a, succ] = rng.dirichlet(np.ones(5))
        perm = rng.permutation(n)
        self.value = np.zeros(n)
        self.value[perm[:4]], self.value[perm[4:8]] = 1.0, -1.0
        self.min_len, self.stop_prob = min_len, stop_prob
        self.rng = rng

    def sample(self, count: int, max_len: int, rng: np.random.Generator | None = None) -> list[list[int]]:
        """``count`` token sequences (<bos> letters... [<eos>]) of at most ``max_len`` letters."""
        rng = rng or self.rng
        out = []
        for _ in range(count):
            a = int(rng.integers(len(LETTERS)))
            seq = [BOS, OFFSET + a]
            while len(seq) - 1 < max_len:
                if len(seq) - 1 >= self.min_len and rng.random() < self.stop_prob:
                    seq.append(EOS)
                    break
                a = int(rng.choice(len(LETTERS), p=self.trans[a]))
                seq.append(OFFSET + a)
            out.append(seq)
        return out

    def true_reward(self, tokens: list[int]) -> float:
        """``sum u[letter] - 2 * #ungrammatical bigrams`` over the letters of ``tokens`` (specials ignored)."""
        letters = [t - OFFSET for t in tokens if t >= OFFSET]
        value = float(sum(self.value[a] for a in letters))
        bad = sum(self.trans[a, b] == 0 for a, b in zip(letters, letters[1:]))
        return value - 2.0 * bad


class TinyLM(nn.Module):
    """A causal transformer LM: ``forward(ids [B, T]) -> logits [B, T, V]``; ``embed.weight`` is shared with the RM."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32, layers: int = 2, heads: int = 2, max_len: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)

    def forward(self, ids: Tensor) -> Tensor:
        t = ids.shape[1]
        h = self.embed(ids) + self.pos(torch.arange(t, device=ids.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
        h = self.blocks(h, mask=mask, is_causal=True)
        return self.norm(h) @ self.embed.weight.T


class ConvRM(nn.Module):
    """Reward on embeddings: ``R = sum_t [a . e_t + w . relu(conv3(e)_t)] + c`` (masked sum over positions).

    Differentiable in the embeddings, as GGRO needs; the embedding table itself belongs to the LM (frozen here).
    """

    def __init__(self, dim: int = 32, hidden: int = 32) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 1)
        self.conv = nn.Conv1d(dim, hidden, kernel_size=3, padding=1)
        self.out = nn.Linear(hidden, 1, bias=False)

    def forward(self, embeds: Tensor, mask: Tensor | None = None) -> Tensor:
        hidden = torch.relu(self.conv(embeds.transpose(1, 2))).transpose(1, 2)
        per_token = self.linear(embeds)[..., 0] + self.out(hidden)[..., 0]
        if mask is not None:
            per_token = per_token * mask
        return per_token.sum(dim=1)


def _pad(seqs: list[list[int]]) -> tuple[Tensor, Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(seqs), width))
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1.0
    return ids, mask


def train_lm(world: World, *, seed: int, steps: int = 300, batch: int = 64, max_len: int = 20,
             lr: float = 3e-3) -> TinyLM:
    """Fit a ``TinyLM`` to grammar samples (next-token cross-entropy, padding ignored); returned in eval mode."""
    torch.manual_seed(seed)
    lm = TinyLM()
    opt = torch.optim.AdamW(lm.parameters(), lr=lr, weight_decay=0.0)
    rng = np.random.default_rng(seed + 1)
    for _ in range(steps):
        ids, mask = _pad(world.sample(batch, max_len, rng))
        logits = lm(ids[:, :-1])
        target = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                           ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    lm.eval()
    for p in lm.parameters():
        p.requires_grad_(False)
    return lm


def train_proxy_rm(world: World, embed: Tensor, *, seed: int, samples: int = 384, steps: int = 150,
                   max_len: int = 20, lr: float = 1e-2) -> ConvRM:
    """Fit a ``ConvRM`` on the frozen shared ``embed`` to the true reward of ``samples`` grammatical sequences
    (MSE). It never sees an ungrammatical sequence, so it cannot learn their penalty (the proxy)."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed + 2)
    seqs = world.sample(samples, max_len, rng)
    ids, mask = _pad(seqs)
    target = torch.tensor([world.true_reward(s) for s in seqs], dtype=torch.float32)
    rm = ConvRM(embed.shape[1])
    opt = torch.optim.Adam(rm.parameters(), lr=lr)
    emb = embed.detach()[ids]
    for _ in range(steps):
        loss = ((rm(emb, mask) - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    rm.eval()
    for p in rm.parameters():
        p.requires_grad_(False)
    return rm
