"""A vectorised frame-level interaction simulator: a scripted user, frame features, and a scripted 'natural' agent.

Every segment is ``frames`` 80 ms frames long and is built around one axis situation (the paper extracts one
short segment per situation from human conversations; here a scripted user plays it):

- ``pause``: the user speaks, pauses mid-turn for 5-11 frames, resumes. Label: the pause span.
- ``turn``: the user speaks, then yields the floor (silence to the end). Label: the turn end (first silent frame).
- ``backchannel``: the user speaks throughout with 2-3 backchannel cues (>= 10 frames apart). Label: cue frames.
- ``interrupt``: the agent is speaking (forced prefix), the user barges in and holds the floor 12-19 frames.

Observed features per frame (what a speech model hears, reduced to 7 numbers): user voice activity; an
end-of-turn prosody cue on the user's last voiced frame before silence, N(1, cue_noise) at a real turn end and
N(0, cue_noise) before a mid-turn pause; a backchannel cue N(1, 0.8 cue_noise) at cue frames; Gaussian noise 0.1 on
both cue channels everywhere; the user's silence run (frames since the user last spoke / 10, capped at 2); and
the agent's previous action, one-hot. The user is scripted (open loop), so the whole feature sequence is a function
of the segment and the agent's past actions, and replaying a rollout through the GRU gives its exact log-probs.
Convention: all of this is ours (the spec's "[ours; operational]" experiment).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from polyrl.families.duplex.rewards import (
    AXES,
    BACKCHANNEL,
    SILENT,
    SPEAK,
    backchannel_reward_batch,
    interruption_reward_batch,
    pause_reward_batch,
    quality_batch,
    turn_taking_reward_batch,
)

FEATURES = 7  # vad, eot cue, bc cue, silence run, prev action one-hot (3)


@dataclass
class Segments:
    """A batch of B scripted segments (tensors [B] or [B, F])."""

    axis: Tensor  # long [B]: index into AXES
    user_vad: Tensor  # bool [B, F]
    eot_cue: Tensor  # float [B, F] (observed)
    bc_cue: Tensor  # float [B, F] (observed)
    cues: Tensor  # bool [B, F]: true backchannel cue frames
    forced: Tensor  # bool [B, F]: agent forced to speak (interrupt prefix)
    pause_start: Tensor  # long [B] (pause segments; else 0)
    pause_end: Tensor
    turn_end: Tensor  # long [B] (turn segments; else 0)
    barge_in: Tensor  # long [B] (interrupt segments; else 0)
    barge_end: Tensor

    @property
    def size(self) -> int:
        return self.axis.shape[0]

    def repeat(self, g: int) -> Segments:
        """Each segment g times in a row (a GRPO group: the same segment, several rollouts)."""
        return Segments(**{k: v.repeat_interleave(g, 0) for k, v in self.__dict__.items()})

    def silence_run(self) -> Tensor:
        """float [B, F]: frames since the user last spoke, / 10, capped at 2 (0 while the user speaks)."""
        B, F = self.user_vad.shape
        run = torch.zeros(B, F)
        cur = torch.zeros(B)
        for f in range(F):
            cur = torch.where(self.user_vad[:, f], torch.zeros_like(cur), cur + 1)
            run[:, f] = cur
        return (run / 10).clamp(max=2.0)


def segment_axes(n: int, rng: np.random.Generator, axes: tuple[str, ...] = AXES) -> np.ndarray:
    """The axis (an index into ``AXES``) of each of n segments, drawn uniformly from ``axes``: ``make_segments``'s
    first draw from ``rng``."""
    return rng.choice([AXES.index(a) for a in axes], size=n)


def make_segments(n: int, frames: int, rng: np.random.Generator, *, axes: tuple[str, ...] = AXES,
                  cue_noise: float = 0.3) -> Segments:
    """n segments, each of an axis drawn uniformly from ``axes``; all randomness from ``rng``."""
    if frames < 40:
        raise ValueError(f"frames = {frames} is not allowed; allowed: >= 40")
    F = frames
    ax = segment_axes(n, rng, axes)
    vad = np.zeros((n, F), bool)
    eot = rng.normal(0, 0.1, (n, F))
    bcc = rng.normal(0, 0.1, (n, F))
    cues = np.zeros((n, F), bool)
    forced = np.zeros((n, F), bool)
    z = np.zeros(n, np.int64)
    ps, pe, te, bi, be = z.copy(), z.copy(), z.copy(), z.copy(), z.copy()
    for i in range(n):
        a = AXES[ax[i]]
        if a == "pause":
            s = rng.integers(10, 20)
            e = s + rng.integers(5, 12)
            vad[i, :s] = True
            vad[i, e:] = True
            eot[i, s - 1] += rng.normal(0.0, cue_noise)
            ps[i], pe[i] = s, e
        elif a == "turn":
            e = rng.integers(12, 24)
            vad[i, :e] = True
            eot[i, e - 1] += rng.normal(1.0, cue_noise)
            te[i] = e
        elif a == "backchannel":
            vad[i, :] = True
            k = rng.integers(2, 4)
            pos, c = [], rng.integers(3, 10)
            while len(pos) < k and c < F - 6:
                pos.append(c)
                c += rng.integers(10, 16)
            cues[i, pos] = True
            bcc[i, pos] += rng.normal(1.0, cue_noise * 0.8, len(pos))
        else:
            b = rng.integers(8, 16)
            e = min(F, b + rng.integers(12, 20))
            forced[i, :b] = True
            vad[i, b:e] = True
            bi[i], be[i] = b, e
    t = torch.from_numpy
    return Segments(axis=t(ax).long(), user_vad=t(vad), eot_cue=t(eot).float(), bc_cue=t(bcc).float(),
                    cues=t(cues), forced=t(forced), pause_start=t(ps), pause_end=t(pe), turn_end=t(te),
                    barge_in=t(bi), barge_end=t(be))


def features(seg: Segments, actions: Tensor, silence: Tensor | None = None) -> Tensor:
    """float [B, F, FEATURES]: the frame features given the agent's actions (the previous one is fed back)."""
    B, F = seg.user_vad.shape
    prev = torch.cat([torch.full((B, 1), SILENT, dtype=torch.long), actions[:, :-1]], 1)
    silence = seg.silence_run() if silence is None else silence
    return torch.cat([torch.stack([seg.user_vad.float(), seg.eot_cue, seg.bc_cue, silence], -1),
                      torch.nn.functional.one_hot(prev, 3).float()], -1)


def frame_features(seg: Segments, silence: Tensor, f: int, prev: Tensor) -> Tensor:
    """float [B, FEATURES] at frame f given the previous action [B] (the rollout's step-by-step view)."""
    return torch.cat([torch.stack([seg.user_vad[:, f].float(), seg.eot_cue[:, f], seg.bc_cue[:, f], silence[:, f]], -1),
                      torch.nn.functional.one_hot(prev, 3).float()], -1)


@dataclass(frozen=True)
class RewardSettings:
    """Reward parameters (spec defaults)."""

    min_gap: int = 2
    max_gap: int = 10
    bc_window: int = 4
    bc_bonus: float = 0.3
    overlap_penalty: float = -0.5
    stop_within: int = 4
    decay: float = 0.25
    w_quality: float = 0.5


def axis_rewards(seg: Segments, actions: Tensor, rs: RewardSettings) -> Tensor:
    """float [B]: each segment's own axis reward (the other axes' formulas are computed and discarded)."""
    r = torch.stack([
        pause_reward_batch(actions, seg.pause_start, seg.pause_end),
        turn_taking_reward_batch(actions, seg.turn_end, min_gap=rs.min_gap, max_gap=rs.max_gap),
        backchannel_reward_batch(actions, seg.user_vad, seg.cues, window=rs.bc_window, bonus=rs.bc_bonus,
                                 overlap_penalty=rs.overlap_penalty),
        interruption_reward_batch(actions, seg.barge_in, seg.barge_end, stop_within=rs.stop_within, decay=rs.decay),
    ], 1)
    return r.gather(1, seg.axis[:, None])[:, 0]


def rewards(seg: Segments, actions: Tensor, rs: RewardSettings) -> Tensor:
    """float [B]: axis reward + w_quality * quality (``combined_reward``, batched)."""
    return axis_rewards(seg, actions, rs) + rs.w_quality * quality_batch(actions)


def natural_agent(seg: Segments, rng: np.random.Generator, *, min_gap: int = 2, noise: float = 1.0) -> Tensor:
    """long [B, F]: the scripted 'natural' agent's actions (it sees the script), with human-like noise.

    pause: takes over with prob 0.3 * noise, 2-4 frames into the pause, until the user has resumed 2 frames;
    turn: starts at turn end + min_gap + U{-1..6 * noise}; backchannel: answers each cue with prob 0.75 after
    U{0..5 * noise} frames (a delay of 4-5 misses the window), plus a stray backchannel with prob 0.2 * noise;
    interrupt: keeps speaking U{1..int(8 * noise)} frames after the barge-in. Speech runs to the segment's end.
    """
    B, F = seg.user_vad.shape
    act = np.zeros((B, F), np.int64)
    for i in range(B):
        a = AXES[int(seg.axis[i])]
        if a == "pause":
            if rng.random() < 0.3 * noise:
                s = int(seg.pause_start[i]) + rng.integers(2, 5)
                act[i, s : min(F, int(seg.pause_end[i]) + 2)] = SPEAK
        elif a == "turn":
            late = rng.integers(-1, max(0, int(round(6 * noise))) + 1)
            act[i, max(0, int(seg.turn_end[i]) + min_gap + late) :] = SPEAK
        elif a == "backchannel":
            for c in np.flatnonzero(seg.cues[i].numpy()):
                if rng.random() < 0.75:
                    act[i, min(F - 1, c + rng.integers(0, int(round(5 * noise)) + 1))] = BACKCHANNEL
            if rng.random() < 0.2 * noise:
                act[i, rng.integers(0, F)] = BACKCHANNEL
        else:
            b = int(seg.barge_in[i])
            act[i, : b + rng.integers(1, max(1, int(8 * noise)) + 1)] = SPEAK
    out = torch.from_numpy(act)
    return torch.where(seg.forced, torch.full_like(out, SPEAK), out)


def axis_metrics(seg: Segments, actions: Tensor, rs: RewardSettings) -> dict[str, float]:
    """Per-axis metrics over a batch (each over the segments of its axis; NaN when there are none).

    pause/takeover_rate (lower is better): share of pause segments where the agent speaks in the pause.
    turn/gap_error (frames, lower is better): |onset - (turn end + min_gap)|, no onset counts as F - turn end -
    min_gap; turn/response_gap: mean onset - turn end over the segments with an onset (information).
    backchannel/rate (higher is better): share of cues answered by a backchannel within the window.
    backchannel/overlap (lower is better): share of user-speech frames where the agent makes sound that is not a
    cue-window backchannel (speech, or a stray backchannel).
    interrupt/yield_frames (lower is better): frames the agent keeps speaking after the barge-in.
    reward/<axis>: mean combined reward on that axis.
    """
    from polyrl.families.duplex.rewards import cue_windows, first_onset, yield_frames

    F = actions.shape[1]
    out: dict[str, float] = {}

    def mean(x: Tensor, m: Tensor) -> float:
        return float(x[m].float().mean()) if bool(m.any()) else float("nan")

    is_ = {a: seg.axis == i for i, a in enumerate(AXES)}
    span = (torch.arange(F) >= seg.pause_start[:, None]) & (torch.arange(F) < seg.pause_end[:, None])
    out["pause/takeover_rate"] = mean(((actions == SPEAK) & span).any(-1), is_["pause"])
    onset = first_onset(actions)
    ideal = seg.turn_end + rs.min_gap
    err = torch.where(onset >= F, (F - ideal).clamp(min=0), (onset - ideal).abs())
    out["turn/gap_error"] = mean(err, is_["turn"])
    out["turn/response_gap"] = mean(onset - seg.turn_end, is_["turn"] & (onset < F))
    bc = actions == BACKCHANNEL
    ahead = torch.zeros_like(bc)
    for k in range(rs.bc_window):
        ahead[:, : F - k] |= bc[:, k:]
    m = is_["backchannel"]
    out["backchannel/rate"] = float((seg.cues & ahead)[m].sum() / seg.cues[m].sum().clamp(min=1)) if bool(m.any()) \
        else float("nan")
    bad = ((actions == SPEAK) | (bc & ~cue_windows(seg.cues, rs.bc_window))) & seg.user_vad
    out["backchannel/overlap"] = float(bad[m].sum() / seg.user_vad[m].sum().clamp(min=1)) if bool(m.any()) \
        else float("nan")
    out["interrupt/yield_frames"] = mean(yield_frames(actions, seg.barge_in, seg.barge_end), is_["interrupt"])
    r = rewards(seg, actions, rs)
    for a in AXES:
        out[f"reward/{a}"] = mean(r, is_[a])
    out["reward/mean"] = float(r.mean())
    return out


# metric -> +1 when higher is better, -1 when lower is better (the report's "improved" test)
METRIC_SIGN = {"pause/takeover_rate": -1, "turn/gap_error": -1, "backchannel/rate": 1, "backchannel/overlap": -1,
               "interrupt/yield_frames": -1}
