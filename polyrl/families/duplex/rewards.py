"""The four interactivity-axis rewards of full-duplex alignment, a quality term, and their combination.

Source: arXiv:2606.11167 (Ohashi, Zeghidour, Defossez, Kharitonov; Kyutai), "Multi-Faceted Interactivity
Alignment in Full-Duplex Speech Models": GRPO with rule-based rewards on four axes (pause handling, turn-taking,
backchanneling, user interruption) plus an LLM-judge quality reward. The exact formulas were not retrieved: every
formula here is ours (spec section 6 (d), "[ours; operational]"), on 80 ms frames (Mimi codec, 12.5 Hz).

A ``Timeline`` is one segment: ``user_vad[F]`` (user speaking) and ``agent_action[F]`` (0 silent, 1 speak,
2 backchannel). Each scalar function has a batched twin (``*_batch``, tensors ``[B, F]``) that the simulator uses;
the scalar one calls it with B = 1, so both agree by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

SILENT, SPEAK, BACKCHANNEL = 0, 1, 2
AXES = ("pause", "turn", "backchannel", "interrupt")


@dataclass
class Timeline:
    """One segment at frame level: user voice activity and the agent's action per 80 ms frame."""

    user_vad: Tensor  # bool [F]
    agent_action: Tensor  # long [F]: 0 silent, 1 speak, 2 backchannel


def _frames(action: Tensor) -> Tensor:
    return torch.arange(action.shape[-1], device=action.device).expand_as(action)


def _span(action: Tensor, start: Tensor, end: Tensor) -> Tensor:
    """bool [B, F]: start[b] <= f < end[b]."""
    f = _frames(action)
    return (f >= start[:, None]) & (f < end[:, None])


def pause_reward_batch(action: Tensor, pause_start: Tensor, pause_end: Tensor, *, takeover_penalty: float = -1.0,
                       hold_bonus: float = 1.0) -> Tensor:
    """[B]: ``takeover_penalty`` if the agent speaks (action 1) in the pause [start, end), else ``hold_bonus``.

    Convention: a backchannel in the pause is not a takeover (it does not take the floor).
    """
    took = ((action == SPEAK) & _span(action, pause_start, pause_end)).any(-1)
    return torch.where(took, torch.full_like(pause_start, takeover_penalty, dtype=torch.float32),
                       torch.full_like(pause_start, hold_bonus, dtype=torch.float32))


def first_onset(action: Tensor) -> Tensor:
    """[B]: first frame with action 1 (speak), or F when the agent never speaks."""
    F = action.shape[-1]
    f = torch.where(action == SPEAK, _frames(action), torch.full_like(action, F))
    return f.min(-1).values


def turn_taking_reward_batch(action: Tensor, turn_end: Tensor, *, min_gap: int = 2, max_gap: int = 10,
                             late_penalty: float = -1.0) -> Tensor:
    """[B]: reward of the agent's first speech onset relative to the user's turn end (frame of first silence).

    gap = onset - turn_end; gap < min_gap (early, including speaking over the user) -> -1;
    min_gap <= gap <= max_gap -> 1 - (gap - min_gap) / (max_gap - min_gap) (1 at exactly min_gap, 0 at max_gap);
    gap > max_gap or no onset -> late_penalty.
    Convention: linear decay inside the window (ours; the paper's shape was not retrieved).
    """
    onset = first_onset(action)
    gap = (onset - turn_end).float()
    inside = 1.0 - (gap - min_gap) / max(max_gap - min_gap, 1)
    r = torch.where(gap < min_gap, torch.full_like(gap, -1.0), inside)
    late = (gap > max_gap) | (onset >= action.shape[-1])  # silence to the end is late, however near the end the turn
    return torch.where(late, torch.full_like(gap, late_penalty), r)


def _starts(mask: Tensor) -> Tensor:
    """bool [B, F]: first frame of each run of True."""
    prev = torch.cat([torch.zeros_like(mask[:, :1]), mask[:, :-1]], dim=1)
    return mask & ~prev


def cue_windows(cues: Tensor, window: int) -> Tensor:
    """bool [B, F]: frames within ``window`` frames from a cue (c <= f < c + window)."""
    w = torch.zeros_like(cues)
    for k in range(window):
        w[:, k:] |= cues[:, : cues.shape[1] - k]
    return w


def backchannel_reward_batch(action: Tensor, user_vad: Tensor, cues: Tensor, *, window: int = 4, bonus: float = 0.3,
                             max_count: int = 3, overlap_penalty: float = -0.5) -> Tensor:
    """[B]: bonus * min(hits, max_count) + overlap_penalty * bad_events.

    A cue at frame c is hit when a backchannel (action 2) occurs in [c, c + window). Bad events: a speech onset
    (action 1) while the user speaks, and a backchannel burst starting outside every cue window.
    Convention: overlap is counted per event (onset), not per frame (ours).
    """
    bc = action == BACKCHANNEL
    ahead = torch.zeros_like(bc)  # ahead[b, c]: a backchannel in [c, c + window)
    F = bc.shape[1]
    for k in range(window):
        ahead[:, : F - k] |= bc[:, k:]
    hits = (cues & ahead).sum(-1).float()
    stray = (_starts(bc) & ~cue_windows(cues, window)).sum(-1)
    talk_over = (_starts(action == SPEAK) & user_vad).sum(-1)
    return bonus * hits.clamp(max=max_count) + overlap_penalty * (stray + talk_over).float()


def yield_frames(action: Tensor, barge_in: Tensor, barge_end: Tensor) -> Tensor:
    """[B]: frames the agent speaks (action 1) from the barge-in until the user's barge-in turn ends.

    Convention: equals "frames until stop" when the agent stops once; speaking again while the user still holds
    the floor counts too (ours).
    """
    return ((action == SPEAK) & _span(action, barge_in, barge_end)).sum(-1)


def interruption_reward_batch(action: Tensor, barge_in: Tensor, barge_end: Tensor, *, stop_within: int = 4,
                              decay: float = 0.25) -> Tensor:
    """[B]: d = yield_frames; r = 1 - decay * d for d <= stop_within, else min(1 - decay * d,
    -decay * (d - stop_within)) (strictly negative past stop_within for any decay); floor -1.

    With the defaults (stop_within 4, decay 0.25) this is exactly max(-1, 1 - 0.25 d).
    """
    d = yield_frames(action, barge_in, barge_end).float()
    r = 1.0 - decay * d
    r = torch.where(d > stop_within, torch.minimum(r, -decay * (d - stop_within)), r)
    return r.clamp(min=-1.0)


def quality_batch(action: Tensor, *, min_burst: int = 3) -> Tensor:
    """[B]: stand-in for the LLM-judge quality score: the fraction of speech frames in bursts of >= min_burst
    frames (a burst that reaches the segment's end counts as complete); 1 when the agent does not speak.

    Convention: ours. The paper's judge scores semantic quality; a frame simulator has no semantics, so fragmented
    speech (stutter, speak/silence flicker) stands in for degradation.
    """
    sp = action == SPEAK
    B, F = sp.shape
    run = torch.zeros(B, dtype=torch.long, device=action.device)
    good = torch.zeros(B, device=action.device)
    total = sp.sum(-1).float()
    for f in range(F):  # burst lengths: close a run when speech stops
        cur = sp[:, f]
        ended = ~cur & (run > 0)
        good += torch.where(ended & (run >= min_burst), run.float(), torch.zeros_like(good))
        run = torch.where(cur, run + 1, torch.zeros_like(run))
    good += run.float()  # a burst reaching the end is complete
    return torch.where(total > 0, good / total.clamp(min=1), torch.ones_like(good))


def _one(tl: Timeline) -> tuple[Tensor, Tensor]:
    return tl.agent_action.long()[None], tl.user_vad.bool()[None]


def _t(x: int) -> Tensor:
    return torch.tensor([int(x)])


def pause_reward(tl: Timeline, pause_spans: list[tuple[int, int]], *, takeover_penalty: float = -1.0,
                 hold_bonus: float = 1.0) -> float:
    """Mean over the labelled pauses [start, end) of ``pause_reward_batch`` (penalty if the agent speaks in it)."""
    a, _ = _one(tl)
    vals = [float(pause_reward_batch(a, _t(s), _t(e), takeover_penalty=takeover_penalty, hold_bonus=hold_bonus))
            for s, e in pause_spans]
    return sum(vals) / len(vals) if vals else hold_bonus


def turn_taking_reward(tl: Timeline, user_turn_end: int, *, min_gap: int = 2, max_gap: int = 10,
                       late_penalty: float = -1.0) -> float:
    """See ``turn_taking_reward_batch``: 1 at onset = turn end + min_gap, -1 when early."""
    a, _ = _one(tl)
    return float(turn_taking_reward_batch(a, _t(user_turn_end), min_gap=min_gap, max_gap=max_gap,
                                          late_penalty=late_penalty))


def backchannel_reward(tl: Timeline, cue_frames: list[int], *, window: int = 4, bonus: float = 0.3,
                       max_count: int = 3, overlap_penalty: float = -0.5) -> float:
    """See ``backchannel_reward_batch``."""
    a, vad = _one(tl)
    cues = torch.zeros_like(vad)
    cues[0, list(cue_frames)] = True
    return float(backchannel_reward_batch(a, vad, cues, window=window, bonus=bonus, max_count=max_count,
                                          overlap_penalty=overlap_penalty))


def interruption_reward(tl: Timeline, barge_in: int, *, stop_within: int = 4, decay: float = 0.25,
                        barge_end: int | None = None) -> float:
    """See ``interruption_reward_batch``; ``barge_end`` defaults to the end of the user's speech run at barge_in."""
    a, vad = _one(tl)
    if barge_end is None:
        barge_end = barge_in
        while barge_end < vad.shape[1] and bool(vad[0, barge_end]):
            barge_end += 1
    return float(interruption_reward_batch(a, _t(barge_in), _t(barge_end), stop_within=stop_within, decay=decay))


def combined_reward(axis: str, tl: Timeline, meta: dict, *, quality_score: float | None, w_quality: float = 0.5,
                    **kw) -> float:
    """r = axis reward + w_quality * quality_score (the quality term is left out when quality_score is None).

    ``meta``: pause -> {"pause_spans"}, turn -> {"user_turn_end"}, backchannel -> {"cue_frames"},
    interrupt -> {"barge_in"[, "barge_end"]}. Convention: additive quality term (ours).
    """
    if axis == "pause":
        r = pause_reward(tl, meta["pause_spans"], **kw)
    elif axis == "turn":
        r = turn_taking_reward(tl, meta["user_turn_end"], **kw)
    elif axis == "backchannel":
        r = backchannel_reward(tl, meta["cue_frames"], **kw)
    elif axis == "interrupt":
        r = interruption_reward(tl, meta["barge_in"], barge_end=meta.get("barge_end"), **kw)
    else:
        raise ValueError(f"axis = {axis!r} is not allowed; allowed: {', '.join(AXES)}")
    return r + (w_quality * quality_score if quality_score is not None else 0.0)
