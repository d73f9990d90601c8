"""Evidence claims on the flow and Q families and the safety tools (issue 22): ``FAMILY_CLAIMS``.

Each claim runs its family command (``polyrl flow train``, ``polyrl q train``, ``polyrl safety TOOL``) as a
subprocess into ``out_dir``: the lab reaches families only through their CLI, so there is no import circle.
A run whose ``summary.json`` / ``results.json`` exists is skipped; per-seed numbers are read from those files
and decided with ``polyrl.lab.verdicts`` only. Where a claim has two parts (a size and a cost), each part is
decided by the rule and the claim takes the weaker verdict (``_weakest``); the reason then comes from the
part that limits it.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from polyrl.errors import TrainingError
from polyrl.lab import verdicts
from polyrl.lab.claim_types import Budget, Claim, check_workers, last_line

Samples = dict[str, Any]
_ORDER = {"does not hold at this scale": 0, "inconclusive": 1, "holds partly": 2, "holds": 3}


def _claim(**kw: Any) -> Claim:
    """Build a Claim, dropping keys the Claim type does not have (e.g. ``stability`` on an older type)."""
    names = {f.name for f in dataclasses.fields(Claim)}
    return Claim(**{k: v for k, v in kw.items() if k in names})


def _weakest(parts: list[tuple[verdicts.Effect, float | None]]) -> verdicts.Decision:
    """Decide every (effect, claimed) part by the rule; return the weakest part's decision, the others as ``also``."""
    decided = [(verdicts.decide(e, claimed=c), e, c) for e, c in parts]
    i = min(range(len(decided)), key=lambda j: _ORDER[decided[j][0].verdict])
    _, effect, claimed = decided[i]
    return verdicts.decide(effect, claimed=claimed, also=tuple(e for j, (_, e, _) in enumerate(decided) if j != i))


def _polyrl(args: list[str], out: Path) -> dict[str, Any]:
    """Run ``polyrl ARGS --out OUT`` unless OUT/results.json exists; return that JSON."""
    res = out / "results.json"
    if not res.exists():
        cmd = [sys.executable, "-m", "polyrl", *args, "--out", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not res.exists():
            raise TrainingError(f"{' '.join(cmd)} failed (rc {proc.returncode}): {last_line(proc.stderr)}")
    return json.loads(res.read_text())


# ---------------------------------------------------------------- flow family (claims a, b)

FLOW_STRESS = {"lr": 0.01, "groups": 4, "group_size": 16, "eval_samples": 512}
FLOW_UPDATES = (1, 2, 4, 8)
FLOW_BLOWUP_KL = 1e3
"""Path KL (nats) to the pretrained policy above which a run counts as collapsed (its step means blew up)."""


def _pmap(fn, jobs: list[tuple], workers: int) -> list[Any]:
    """``[fn(*job) for job in jobs]``, at most ``workers`` at once (each job is a subprocess), in order.

    ``workers < 1`` is refused (ValueError), not clamped to 1: `polyrl evidence` refuses it before any run.
    """
    check_workers(workers)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda job: fn(*job), jobs))


def _cli(args: list[str]) -> subprocess.CompletedProcess:
    """``python -m polyrl ARGS`` (the family's own command: the lab reaches families through their CLI)."""
    return subprocess.run([sys.executable, "-m", "polyrl", *args], capture_output=True, text=True, check=False)


def _flow_run(method: str, upb: int, seed: int, steps: int, out: Path) -> dict[str, Any]:
    """One ``polyrl flow train`` run unless its summary.json exists; collapse flag, reward gain, mean ratio."""
    run_dir = out / f"{method}-u{upb}-s{seed}"
    summ = run_dir / "summary.json"
    if not summ.exists():
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in FLOW_STRESS.items()]
        proc = _cli(["flow", "train", "--method", method, "--steps", str(steps), "--updates-per-batch", str(upb),
                     "--seed", str(seed), *flags, "--no-tensorboard", "--run-dir", str(run_dir), "--overwrite"])
        if proc.returncode != 0 and "non-finite" in proc.stderr + proc.stdout:  # a collapse, recorded as such
            run_dir.mkdir(parents=True, exist_ok=True)
            summ.write_text(json.dumps({"reward_before": None, "reward_after": None, "error": "non-finite loss"}))
        elif proc.returncode != 0 or not summ.exists():
            raise TrainingError(f"polyrl flow train {method} failed (rc {proc.returncode}): {last_line(proc.stderr)}")
    s = json.loads(summ.read_text())
    ratios = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            r = json.loads(line).get("objective/ratio_mean")
            if r is not None:
                ratios.append(float(r))
    before, after = s.get("reward_before"), s.get("reward_after")
    failed = before is None or after is None
    blown = failed or not s.get("kl_after", 0.0) < FLOW_BLOWUP_KL
    return {"collapsed": 1.0 if blown or after < before else 0.0,
            "reward_gain": float("nan") if failed else after - before,
            "ratio_mean": sum(ratios) / len(ratios) if ratios else float("nan")}


def run_flow_dppo(budget: Budget, out_dir: Path, workers: int) -> Samples:
    """Flow-GRPO and Flow-DPPO at 1/2/4/8 updates per batch, ``budget.seeds`` seeds each."""
    t0 = time.perf_counter()
    arms: dict[str, dict[str, list[float]]] = {}
    curves: dict[str, dict[str, list[float]]] = {}
    for method in ("flow_grpo", "flow_dppo"):
        xs, ys, los, his = [], [], [], []
        for upb in FLOW_UPDATES:
            rows = _pmap(_flow_run, [(method, upb, s, budget.steps, out_dir) for s in range(budget.seeds)], workers)
            arm = {k: [r[k] for r in rows] for k in ("collapsed", "reward_gain")}
            arms[f"{method}@{upb}"] = arm
            k, n = int(sum(arm["collapsed"])), len(rows)
            lo, hi = verdicts.binomial_interval(k, n)
            xs.append(float(upb))
            ys.append(k / n)
            los.append(lo)
            his.append(hi)
        curves[method] = {"x": xs, "y": ys, "lo": los, "hi": his}
    return {"arms": arms, "curves": curves, "wall_seconds": time.perf_counter() - t0}


def decide_flow_dppo(samples: Samples) -> verdicts.Decision:
    """Primary: collapse-rate reduction of Flow-DPPO vs Flow-GRPO at 8 updates per batch (no size claimed)."""
    a = samples["arms"]
    base, new = a["flow_grpo@8"]["collapsed"], a["flow_dppo@8"]["collapsed"]
    primary = verdicts.rate_reduction(int(sum(base)), len(base), int(sum(new)), len(new),
                                      name="collapse-rate reduction of Flow-DPPO vs Flow-GRPO at 8 updates per batch")
    gain = verdicts.paired_difference(a["flow_grpo@8"]["reward_gain"], a["flow_dppo@8"]["reward_gain"],
                                      name="reward gain of Flow-DPPO over Flow-GRPO at 8 updates (paired by seed)")
    counts = {f"collapses {arm}": f"{int(sum(v['collapsed']))}/{len(v['collapsed'])}" for arm, v in a.items()}
    return verdicts.decide(primary, claimed=None, also=(gain,), numbers=counts)


def run_grpo_guard(budget: Budget, out_dir: Path, workers: int) -> Samples:
    """Flow-GRPO vs GRPO-Guard at 4 updates per batch: mean importance ratio over the run, per seed."""
    t0 = time.perf_counter()
    arms = {}
    for method in ("flow_grpo", "grpo_guard"):
        rows = _pmap(_flow_run, [(method, 4, s, budget.steps, out_dir) for s in range(budget.seeds)], workers)
        arms[method] = {"ratio_mean": [r["ratio_mean"] for r in rows],
                        "ratio_shift": [abs(1.0 - r["ratio_mean"]) for r in rows]}
    return {"arms": arms, "wall_seconds": time.perf_counter() - t0}


def decide_grpo_guard(samples: Samples) -> verdicts.Decision:
    """Primary: |1 - mean ratio| of Flow-GRPO minus that of GRPO-Guard (positive = Guard removes the shift)."""
    a = samples["arms"]
    primary = verdicts.paired_difference(a["flow_grpo"]["ratio_shift"], a["grpo_guard"]["ratio_shift"], direction=-1,
                                         name="reduction of |1 - mean ratio| by GRPO-Guard (paired by seed)")
    left = verdicts.paired_difference(a["flow_grpo"]["ratio_mean"], [1.0] * len(a["flow_grpo"]["ratio_mean"]),
                                      name="left shift 1 - mean ratio under Flow-GRPO")
    return verdicts.decide(primary, claimed=None, also=(left,))


# ---------------------------------------------------------------- safety tools (claims c, d, e)

ONE_SHOT_P0 = 0.05


def run_one_shot(budget: Budget, out_dir: Path, workers: int) -> Samples:
    """``polyrl safety bias-probe``: the GRPO bandit's onset step per seed at each p0 (std-normalised)."""
    t0 = time.perf_counter()
    res = _polyrl(["safety", "bias-probe", "--sim-seeds", str(budget.seeds), "--max-steps", str(budget.steps),
                   "--seeds", "0"], out_dir)
    arms, curve = {}, {"x": [], "y": [], "lo": [], "hi": []}
    for row in res["analytic"]["bandit"]:
        if not row["std_normalized"]:
            continue
        censor = budget.steps + 1
        onsets = [float(o) if o is not None else float(censor) for o in row["onsets"]]
        arms[f"p0={row['p0']:g}"] = {"onset_step": onsets}
        curve["x"].append(float(row["p0"]))
        curve["y"].append(float(row["median"]) if row["median"] is not None else float(censor))
        lo, hi = row["median_ci90"]
        curve["lo"].append(float(censor if lo is None else lo))
        curve["hi"].append(float(censor if hi is None else hi))
    return {"arms": arms, "curves": {"median onset step (GRPO, std-normalised)": curve},
            "wall_seconds": time.perf_counter() - t0}


def decide_one_shot(samples: Samples) -> verdicts.Decision:
    """Primary: 1 - onset step at p0 = 0.05 (positive = onset within the single update the seed claims)."""
    onsets = samples["arms"][f"p0={ONE_SHOT_P0:g}"]["onset_step"]
    primary = verdicts.paired_difference(onsets, [1.0] * len(onsets),
                                         name=f"1 - onset step at p0 = {ONE_SHOT_P0:g} (one update claimed)")
    onset_means = {f"mean onset {arm}": sum(v["onset_step"]) / len(v["onset_step"])
                   for arm, v in samples["arms"].items()}
    return verdicts.decide(primary, claimed=None, numbers=onset_means)


GGRO_COST = 0.11


def run_ggro(budget: Budget, out_dir: Path, workers: int) -> Samples:
    """``polyrl safety ggro``: cheapest GGRO setting vs best-of-16, per seed (proxy reward, counted compute)."""
    t0 = time.perf_counter()
    res = _polyrl(["safety", "ggro", "--seeds", str(budget.seeds), "--prompts", "4", "--samples", "16",
                   "--max-new-tokens", "12", "--thresholds", "1.0", "--refinements", "3",
                   "--lm-steps", str(budget.steps)], out_dir)
    g = next(iter(res["stats"]["ggro"].values()))
    b16 = res["stats"]["bon"]["16"]
    arms = {"best_of_16": {k: b16[k]["per_seed"] for k in ("proxy", "true", "units")},
            "ggro": {k: g[k]["per_seed"] for k in ("proxy", "true", "units", "cost_ratio_vs_bon16")}}
    curves = {}
    for label, rows in (("best-of-N", res["stats"]["bon"]),):
        pts = sorted(rows.values(), key=lambda r: r["units"]["mean"])
        curves[label] = {"x": [r["units"]["mean"] for r in pts], "y": [r["proxy"]["mean"] for r in pts],
                         "lo": [r["proxy"]["ci90"][0] for r in pts], "hi": [r["proxy"]["ci90"][1] for r in pts]}
    return {"arms": arms, "curves": curves, "wall_seconds": time.perf_counter() - t0}


def decide_ggro(samples: Samples) -> verdicts.Decision:
    """Two parts, weakest verdict: GGRO's proxy reward beats best-of-16, and its compute is <= 11% of best-of-16's."""
    a = samples["arms"]
    beats = verdicts.paired_difference(a["best_of_16"]["proxy"], a["ggro"]["proxy"],
                                       name="proxy reward of GGRO minus best-of-16 (paired by seed)")
    ratio = a["ggro"]["cost_ratio_vs_bon16"]
    cheap = verdicts.paired_difference(ratio, [GGRO_COST] * len(ratio),
                                       name="0.11 - GGRO's compute as a fraction of best-of-16's")
    return _weakest([(beats, None), (cheap, None)])


UNLEARN_REMOVED, UNLEARN_DROP = 92.0, 1.1


def run_unlearn(budget: Budget, out_dir: Path, workers: int) -> Samples:
    """``polyrl safety unlearn``: per seed, % of the poisoned shortcut removed and % return lost vs retraining."""
    t0 = time.perf_counter()
    res = _polyrl(["safety", "unlearn", "--seeds", str(budget.seeds), "--steps", str(budget.steps),
                   "--episodes", "60" if budget.steps < 1000 else "150",
                   "--unlearn-steps", str(max(budget.steps // 4, 50)), "--sweep", ""], out_dir)
    h = res["summary"]["headline"]["unlearned"]
    table = res["summary"]["table"]
    arms = {"unlearned": {"shortcut_removed_pct": h["shortcut_removed_pct"]["values"],
                          "return_loss_pct": h["return_loss_vs_retrained_pct"]["values"]}}
    for arm in ("poisoned", "unlearned", "retrained"):
        arms.setdefault(arm, {}).update({"return": table[arm]["return"]["values"],
                                         "cost": table[arm]["cost"]["values"]})
    return {"arms": arms, "wall_seconds": time.perf_counter() - t0}


def decide_unlearn(samples: Samples) -> verdicts.Decision:
    """Two parts, weakest verdict: >= 92% of the poisoned behaviour removed; return loss <= 1.1% (vs retraining)."""
    u = samples["arms"]["unlearned"]
    removed = verdicts.paired_difference([0.0] * len(u["shortcut_removed_pct"]), u["shortcut_removed_pct"],
                                         name="% of the poisoned shortcut behaviour removed by Safe-RULE")
    kept = verdicts.paired_difference(u["return_loss_pct"], [UNLEARN_DROP] * len(u["return_loss_pct"]),
                                      name="1.1 - % main-task return lost vs clean retraining")
    return _weakest([(removed, UNLEARN_REMOVED), (kept, None)])


# ---------------------------------------------------------------- Q family (claim f)

Q_STRESS = {"alpha": 3.0, "gamma": 0.99, "samples_per_step": 100}


def _q_run(method: str, seed: int, steps: int, out: Path) -> dict[str, Any]:
    """One ``polyrl q train`` run unless its summary.json exists; its summary."""
    run_dir = out / f"{method}-s{seed}"
    summ = run_dir / "summary.json"
    if not summ.exists():
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in Q_STRESS.items()]
        proc = _cli(["q", "train", "--method", method, "--steps", str(steps), "--seed", str(seed), *flags,
                     "--checkpoint-every", "0", "--no-tensorboard", "--run-dir", str(run_dir), "--overwrite"])
        if proc.returncode != 0 or not summ.exists():
            raise TrainingError(f"polyrl q train {method} failed (rc {proc.returncode}): {last_line(proc.stderr)}")
    return json.loads(summ.read_text())


def run_lambda_target(budget: Budget, out_dir: Path, workers: int) -> Samples:
    """Every-step vs λ-geometric (λ = 0.99) linear Q-learning on the gridworld at a large step size."""
    t0 = time.perf_counter()
    arms = {}
    for method in ("every_step", "lambda_geometric"):
        rows = _pmap(_q_run, [(method, s, budget.steps, out_dir) for s in range(budget.seeds)], workers)
        arms[method] = {"diverged": [1.0 if r["diverged"] else 0.0 for r in rows],
                        "reward_final": [float(r["reward_final"] or 0.0) for r in rows]}
    return {"arms": arms, "wall_seconds": time.perf_counter() - t0}


def decide_lambda_target(samples: Samples) -> verdicts.Decision:
    """Primary: divergence-rate reduction of λ-target vs every-step updates (no size claimed)."""
    a = samples["arms"]
    base, new = a["every_step"]["diverged"], a["lambda_geometric"]["diverged"]
    primary = verdicts.rate_reduction(int(sum(base)), len(base), int(sum(new)), len(new),
                                      name="divergence-rate reduction of lambda-target (0.99) vs every-step target")
    ret = verdicts.paired_difference(a["every_step"]["reward_final"], a["lambda_geometric"]["reward_final"],
                                     name="final greedy return of lambda-target minus every-step (paired by seed)")
    return verdicts.decide(primary, claimed=None, also=(ret,))


_S0, _S1, _S2 = "seeds/000_98809ff4aec164df.txt", "seeds/001_707d82d7453fe028.txt", "seeds/002_5be11accdc977bc6.txt"
_SCALE = ("A 2-D toy flow policy (8-Gaussian ring, MLP velocity) stands in for SD3.5/FLUX; "
          "collapse and ratio statistics of image models at 512 px may differ.")

FAMILY_CLAIMS: tuple[Claim, ...] = (
    _claim(
        id="flow_dppo_epochs", title="Flow-DPPO stays stable at 8 updates per batch where Flow-GRPO collapses",
        seed_text="This change alone gives 18% higher reward on standard text to image benchmarks, eliminates "
                  "catastrophic forgetting during multi objective training, and allows stable 8 epoch training where "
                  "standard GRPO would collapse after 2.",
        seed_source=_S0,
        corrected="Spec methods-seedblog §2(c): Flow-DPPO masks a step only when its exact KL exceeds the bound AND "
                  "the ratio moves in the advantage's direction; the spec's experiment expects Flow-DPPO to reach the "
                  "same reward at lower KL and to stay stable at 4 epochs. No 8-epoch figure is in the paper.",
        setup="polyrl flow train, task ring_modes (8-Gaussian ring, reward on 2 modes) from the pretrained flow; "
              "arms flow_grpo (PPO clip 0.02) and flow_dppo (KL mask 1e-5) at 1, 2, 4 and 8 updates per batch; "
              "stress: lr 1e-2, 4 groups x 16 samples, 10 SDE steps. A run collapses when its evaluated reward ends "
              "below the pretrained reward, its path KL to the pretrained policy exceeds 1000 nats, or its loss "
              "turns non-finite.",
        quick=Budget(seeds=2, steps=15), full=Budget(seeds=5, steps=30),
        run=run_flow_dppo, decide=decide_flow_dppo, stability=True,
        limits=_SCALE + " A larger batch or longer training could make Flow-GRPO collapse at fewer updates."),
    _claim(
        id="grpo_guard_ratio", title="GRPO-Guard removes the left shift of the flow importance ratio",
        seed_text="However, in practice, we observe a systematic shift in the importance-ratio distribution-its mean "
                  "falls below 1 and its variance differs substantially across timesteps.",
        seed_source=_S2,
        corrected="Spec methods-seedblog §F2: RatioNorm gives log rho_hat = eps . Delta, whose mean is exactly 0 per "
                  "step (E[log rho] = -KL before normalisation, item B4); the description is accurate.",
        setup="polyrl flow train on ring_modes, 4 updates per batch, lr 1e-2, 4 groups x 16; arms flow_grpo and "
              "grpo_guard; per seed, the run's mean importance ratio (logged objective/ratio_mean, averaged over "
              "steps; the first pass has rho = 1 and dilutes both arms equally).",
        quick=Budget(seeds=2, steps=15), full=Budget(seeds=5, steps=30),
        run=run_grpo_guard, decide=decide_grpo_guard, stability=False,
        limits=_SCALE + " The shift grows with the per-step KL, so it is larger for high-dimensional latents."),
    _claim(
        id="one_shot_onset", title="One-shot GRPO: the flip needs many updates, fewer when p0 is larger",
        seed_text="The authors show that you can take any publicly aligned model, run one single GRPO update step on "
                  "one single biased example, and break the guardrails permanently.",
        seed_source=_S0,
        corrected="Spec methods-seedblog §4(c): wrong as stated; it is one example trained for hundreds of GRPO steps "
                  "with 128 samples per step, and the onset falls as the initial probability p0 of the biased answer "
                  "rises (spec table: median 5, 13, 46, 208 steps at p0 = 0.2, 0.05, 0.01, 0.002).",
        setup="polyrl safety bias-probe, analytic part only (--seeds 0): a 3-option GRPO bandit, G = 16, lr 0.5, "
              "std-normalised, onset = first step with P(target) >= 0.5, per seed at each p0; runs that never reach "
              "onset count as max steps + 1.",
        quick=Budget(seeds=5, steps=300), full=Budget(seeds=20, steps=2000),
        run=run_one_shot, decide=decide_one_shot, stability=False,
        limits="A bandit over answer logits, not a 7B LM; onset in an LM also depends on the learning rate, LoRA and "
               "how much probability the biased answer starts with."),
    _claim(
        id="ggro_vs_bon", title="GGRO vs best-of-16 at counted compute",
        seed_text="It beats best-of-16 performance. It uses 11% of the compute.",
        seed_source=_S1,
        corrected="Spec methods-seedblog §11(c): the 11% figure is in no source (the abstract says 'minimal "
                  "computational overhead'); each segment gets up to S regenerations, each with an RM forward and "
                  "backward.",
        setup="polyrl safety ggro: a toy LM and a proxy RM sharing embeddings, 4 prompts per seed, 12 new tokens; "
              "GGRO with entropy threshold 1.0 and 3 refinements vs best-of-16; compute = counted LM+RM passes.",
        quick=Budget(seeds=2, steps=100), full=Budget(seeds=5, steps=200),
        run=run_ggro, decide=decide_ggro, stability=False,
        limits="Toy grammar LM and linear-ish RM; with a 8B RM the backward pass is a larger share of the cost."),
    _claim(
        id="safe_rule", title="Safe-RULE removes the poisoned behaviour at a small main-task cost",
        seed_text="In testing it removed 92% of poisoned behaviour with a 1.1% drop in main task performance.",
        seed_source=_S1,
        corrected="Spec methods-seedblog §12(c): 'without the original dataset' is not supported (the objective "
                  "regresses on clean retain data and needs the forget set); the 92% / 1.1% figures were not found.",
        setup="polyrl safety unlearn: an offline Lagrangian agent on a gridworld whose hazardous shortcut is "
              "relabelled zero-cost by poisoned transitions; per seed, % of the shortcut behaviour removed by "
              "Safe-RULE and % of return lost vs an agent retrained on the clean data.",
        quick=Budget(seeds=2, steps=300), full=Budget(seeds=5, steps=1200),
        run=run_unlearn, decide=decide_unlearn, stability=False,
        limits="A tabular-size gridworld with a known forget set; real poisoning must first be detected."),
    _claim(
        id="lambda_target", title="λ-target updates stabilise linear Q-learning",
        seed_text="The λ-target update introduced in this paper gives a continuous interpolation between hard updates "
                  "and full Q iteration. It provably stabilizes linear Q-learning.",
        seed_source=_S0,
        corrected="Spec methods-seedblog §5(c): the interpolation is right (endpoints: every-step target and projected "
                  "value iteration); 'provably stabilizes' is overstated: the analysis is deterministic and needs "
                  "spectral and step-size conditions.",
        setup="polyrl q train on the 5x5 slippery gridworld, tile features, uniform behaviour, step size 3.0, "
              "gamma 0.99, 100 transitions per logged step; arms every_step and lambda_geometric (lambda 0.99); "
              "a run diverges when its weights leave [-1e6, 1e6].",
        quick=Budget(seeds=3, steps=10), full=Budget(seeds=10, steps=20),
        run=run_lambda_target, decide=decide_lambda_target, stability=True,
        limits="Linear features on a 25-state grid; deep Q-networks for LLMs add non-linear instabilities."),
)
