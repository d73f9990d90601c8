"""A small GRU policy over frame features: one categorical action (silent / speak / backchannel) per 80 ms frame."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from polyrl.errors import TrainingError
from polyrl.families.duplex.rewards import SPEAK
from polyrl.families.duplex.sim import FEATURES, Segments, frame_features


class GRUPolicy(nn.Module):
    """pi(a_f | features_{<=f}) = softmax(W h_f), h_f = GRU(x_f, h_{f-1}); causal, so replay equals rollout."""

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.gru = nn.GRU(FEATURES, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 3)

    def logits(self, feats: Tensor) -> Tensor:
        """[B, F, 3] from features [B, F, FEATURES]."""
        out, _ = self.gru(feats)
        return self.head(out)

    def logp(self, feats: Tensor, actions: Tensor) -> Tensor:
        """[B, F]: log pi(action_f | features_{<=f})."""
        return torch.log_softmax(self.logits(feats), -1).gather(-1, actions[..., None])[..., 0]

    @torch.no_grad()
    def rollout(self, seg: Segments, generator: torch.Generator, silence: Tensor | None = None) -> Tensor:
        """long [B, F]: sample an action per frame, feeding each back as the next frame's 'previous action';
        forced frames (interrupt prefix) are overwritten with speak."""
        B, F = seg.user_vad.shape
        silence = seg.silence_run() if silence is None else silence
        prev = torch.zeros(B, dtype=torch.long)
        h = None
        acts = torch.empty(B, F, dtype=torch.long)
        for f in range(F):
            out, h = self.gru(frame_features(seg, silence, f, prev)[:, None], h)
            probs = torch.softmax(self.head(out[:, 0]), -1)
            if not bool(torch.isfinite(probs).all()):  # diverged weights: stop in one line, not in multinomial
                raise TrainingError("non-finite action probabilities in a rollout")
            a = torch.multinomial(probs, 1, generator=generator)[:, 0]
            a = torch.where(seg.forced[:, f], torch.full_like(a, SPEAK), a)
            acts[:, f] = a
            prev = a
        return acts
