"""The evidence claim registry (issue 22): ``CLAIMS``, ``register`` and the language-model claims.

Each LM claim runs ordinary `polyrl train` runs through the lab (polyrl/lab/compare.py) and decides with the rule
in polyrl/lab/verdicts.py. Runs live in ``OUT/runs/<key>/seed<k>`` where ``key`` is a hash of the preset, the
flags and the steps, so two claims that use the same arm with the same settings share its runs.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from polyrl.errors import TrainingError
from polyrl.lab import verdicts
from polyrl.lab.asymptote import failed_fits, fit_curves, paired_asymptote, seed_asymptote
from polyrl.lab.claim_types import Budget, Claim, Samples, last_line

CLAIMS: dict[str, Claim] = {}
QUICK, FULL = Budget(2, 15), Budget(3, 100)
EVAL = ["--eval-every", "5", "--log-every", "1"]
STRESS = ["--epochs-per-batch", "4", "--lr", "3e-4"]  # README's stress example (stale multi-epoch data)
SEED_OFFICE, SEED_DRPO, SEED_BLOG = "seeds/000_98809ff4aec164df.txt", "seeds/001_707d82d7453fe028.txt", \
    "seeds/003_fc64641978215ab3.txt"


def register(claim: Claim) -> Claim:
    """Add ``claim`` to ``CLAIMS`` (ids are unique)."""
    if claim.id in CLAIMS:
        raise ValueError(f"claim id = {claim.id!r}: already registered")
    CLAIMS[claim.id] = claim
    return claim


def arm_key(preset: str, flags: list[str], shared: list[str], steps: int) -> str:
    """The run directory name of an arm: the preset plus a hash of everything that changes what runs."""
    h = hashlib.sha1(repr((preset, sorted(flags), sorted(shared), steps)).encode()).hexdigest()[:10]
    return f"{preset}-{h}"


def run_stats(run: Any, *, threshold: float) -> dict[str, float]:
    """Per-seed numbers of one lab Run: final/mean accuracy, entropy over the last quarter, collapse, length..."""
    from polyrl.collapse import CollapseRule, first_collapse
    from polyrl.lab.analysis import ACC, ENTROPY, LENGTH

    def last(key, frac=None):
        v = run.series(key)[1]
        if not v.size:
            return float("nan")
        return float(v[-1]) if frac is None else float(np.mean(v[-max(1, int(len(v) * frac)):]))

    steps, acc = run.series(ACC)
    hit = np.flatnonzero(acc >= threshold)
    total = int(max(run.by_step()) if run.by_step() else 0)
    return {
        "final_accuracy": last(ACC),
        "worst_accuracy": float(np.min(acc)) if acc.size else float("nan"),
        "worst_learner_accuracy": float(np.min(la)) if (la := run.series("eval/learner_accuracy")[1]).size
        else float("nan"),
        "accuracy_first": float(acc[0]) if acc.size else float("nan"),
        "entropy_last_quarter": last(ENTROPY, 0.25),
        "length_last_quarter": last(LENGTH, 0.25),
        "utilization": last("rollout/utilization", 1.0),
        "collapsed": float(first_collapse(run.rows, CollapseRule()) is not None),
        "steps_to_threshold": float(steps[hit[0]]) if hit.size else float(total + 1),
        "reached_threshold": float(hit.size > 0),
    }


def lm_arms(out: Path, budget: Budget, workers: int, arms: dict[str, tuple[str, list[str]]],
            shared: list[str] | None = None, *, threshold: float = 0.5,
            per_run: Callable[[Any], dict[str, float]] | None = None) -> Samples:
    """Run every arm for ``budget`` (seeds 0..seeds-1, --steps budget.steps); return per-arm per-seed numbers.

    Finished runs are skipped and interrupted ones resumed (the lab's plan_runs); runs are shared across claims
    through ``arm_key``. ``curves`` holds each arm's mean held-out accuracy against steps. ``per_run(run)`` adds a
    claim's own per-seed numbers (from the lab Run, whose ``path`` is the run directory) to ``run_stats``'.
    """
    from rich.console import Console

    from polyrl.lab.analysis import ACC, load_runs
    from polyrl.lab.compare import plan_runs, run_all

    t0 = time.perf_counter()
    shared = [*(shared or []), "--steps", str(budget.steps)]
    root = Path(out).parent / "runs"  # OUT/<claim> -> OUT/runs, shared by every claim
    keys = {label: arm_key(preset, flags, shared, budget.steps) for label, (preset, flags) in arms.items()}
    seeds = list(range(budget.seeds))
    specs = []
    for label, (preset, flags) in arms.items():
        specs += plan_runs([keys[label]], seeds, root, shared, {keys[label]: flags}, None, workers,
                           presets={keys[label]: preset})
    if specs and "--model" not in shared:  # the task's warm start, built once before the runs (as `polyrl compare`)
        task = shared[shared.index("--task") + 1] if "--task" in shared else "addition"
        built = subprocess.run([sys.executable, "-m", "polyrl", "warmstart", "--task", task],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if built.returncode:
            raise TrainingError(f"polyrl warmstart --task {task} failed (rc {built.returncode}): "
                                f"{last_line(built.stderr)}")
    if specs:
        failed = [s.name for s, code, _ in run_all(specs, workers=workers, console=Console(stderr=True)) if code]
        if failed:
            raise TrainingError(f"runs failed: {', '.join(failed)} (see their METHOD/seedK.train.log under {root})")
    loaded = load_runs(root)
    samples: Samples = {"arms": {}, "curves": {}}
    for label, key in keys.items():
        runs = [r for r in loaded.get(key, []) if r.seed in seeds]
        stats = [{**run_stats(r, threshold=threshold), **(per_run(r) if per_run else {})} for r in runs]
        samples["arms"][label] = {k: [s[k] for s in stats] for k in (stats[0] if stats else {})}
        samples["arms"][label]["seeds"] = [r.seed for r in runs]
        xs = sorted({float(s) for r in runs for s in r.series(ACC)[0]})
        per_x = [[float(v) for r in runs for s, v in zip(*r.series(ACC), strict=True) if s == x] for x in xs]
        ymeans = [float(np.mean(p)) for p in per_x]
        samples["curves"][label] = {"x": xs, "y": ymeans, "lo": [float(np.min(p)) for p in per_x],
                                    "hi": [float(np.max(p)) for p in per_x], "label": "held-out accuracy"}
    samples["wall_seconds"] = time.perf_counter() - t0
    return samples


def eval_prompts(budget: Budget) -> int:
    """Held-out prompts per evaluation: 8 for a micro test (< 10 steps), 50 for quick runs, 100 for full ones."""
    return 8 if budget.steps < 10 else 50 if budget.steps < 50 else 100


def _paired(s: Samples, base: str, new: str, stat: str, name: str, direction: int = +1) -> verdicts.Effect:
    return verdicts.paired_difference(s["arms"][base][stat], s["arms"][new][stat], name=name, direction=direction)


def _reached_steps(s: Samples, arm: str) -> list[float | None]:
    """Per seed, the steps to the threshold, None where the run never reached it (``ratio_of_means`` counts those)."""
    a = s["arms"][arm]
    return [v if hit else None for v, hit in zip(a["steps_to_threshold"], a["reached_threshold"])]


def _censor(s: Samples) -> float:
    """What a run that never reached the threshold counts as: its steps + 1 (``run_stats``), the same for every run."""
    return max(v for arm in s["arms"].values() for v in arm["steps_to_threshold"])


def _count(s: Samples, arm: str, stat: str = "collapsed") -> tuple[int, int]:
    v = s["arms"][arm][stat]
    return int(round(sum(v))), len(v)


PACKAGE = Path(__file__).parents[1]  # polyrl/: the warm starts it ships


def _shown(flag: str) -> str:
    """A flag as the setup text shows it: a path inside the package relative to the checkout (the same text, and so
    the same claim fingerprint, wherever polyrl lies)."""
    return str(Path(flag).relative_to(PACKAGE.parent)) if Path(flag).is_relative_to(PACKAGE) else flag


def _lm(id: str, title: str, seed_text: str, seed_source: str, corrected: str, setup: str,
        arms: dict | Callable[[Budget], dict], decide, limits: str, shared: list[str] | None = None,
        quick: Budget = QUICK, full: Budget = FULL, stability: bool = False, task: str = "addition",
        threshold: float = 0.5, per_run: Callable[[Any], dict[str, float]] | None = None,
        post: Callable[[Samples], Samples] | None = None) -> Claim:
    """Register an LM claim; ``arms`` may depend on the budget (a function of it: the setup text shows the full
    budget's arms); ``per_run`` adds per-seed numbers (``lm_arms``), ``post`` rewrites the samples (e.g. curves)."""
    flags = ["--task", task, *EVAL, *(shared or [])]

    def arms_at(budget: Budget) -> dict:
        return arms(budget) if callable(arms) else arms

    def run(budget: Budget, out: Path, workers: int) -> Samples:
        samples = lm_arms(out, budget, workers, arms_at(budget),
                          [*flags, "--eval-prompts", str(eval_prompts(budget))], threshold=threshold, per_run=per_run)
        return post(samples) if post is not None else samples

    setup = f"{setup} Shared flags: `{' '.join(flags)}` (held-out prompts: 50 quick, 100 full); arms" + \
        (" at the full budget" if callable(arms) else "") + ": " + "; ".join(
        f"{label} = `{' '.join([p, *map(_shown, f)])}`" for label, (p, f) in arms_at(full).items()) + "."
    return register(Claim(id=id, title=title, seed_text=seed_text, seed_source=seed_source, corrected=corrected,
                          setup=setup, quick=quick, full=full, run=run, decide=decide, limits=limits,
                          stability=stability))


LIMITS_LM = ("A ~1M-parameter character model on 2-digit addition from a warm start, ~100 steps: effects that need "
             "long chains of thought, large vocabularies or thousands of steps cannot show here.")

_lm("dapo_clip_higher", "DAPO clip-higher keeps entropy higher than symmetric clipping",
    "DAPO therefore decouples the clip bounds and uses a larger upper bound \\\\epsilon\\_\\{\\\\text\\{high\\}\\} = "
    "0\\.28, keeping \\\\epsilon\\_\\{\\\\text\\{low\\}\\} = 0\\.2 (asymmetric clipping).", SEED_BLOG,
    "",
    "Tested as entropy first (clip-higher lets low-probability tokens rise, the DAPO paper's stated purpose) and "
    "accuracy second. Clip-higher (eps_low 0.2, eps_high 0.28) against symmetric clip 0.2, both token-mean "
    "GRPO, paired by seed; "
    "4 minibatches per batch so that the ratio leaves 1 and the clip acts (with one update per batch it never does).",
    {"symmetric": ("grpo", ["--trust-region", "clip:eps_low=0.2,eps_high=0.2", "--aggregation", "token_mean"]),
     "clip_higher": ("grpo", ["--trust-region", "clip:eps_low=0.2,eps_high=0.28", "--aggregation", "token_mean"])},
    lambda s: verdicts.decide(
        _paired(s, "symmetric", "clip_higher", "entropy_last_quarter",
                "entropy gain of clip-higher over symmetric clip (last quarter, paired by seed)"),
        also=(_paired(s, "symmetric", "clip_higher", "final_accuracy", "accuracy gain of clip-higher (paired)"),)),
    LIMITS_LM + " Entropy collapse in the DAPO paper appears after hundreds of steps on long answers.",
    shared=["--minibatches", "4"])

_lm("drgrpo_length_bias", "Sequence-mean aggregation lengthens wrong answers; token-sum (Dr. GRPO) does not",
    "the standard sample-level loss normalization introduces a bias favoring short correct responses and long",
    SEED_BLOG, "",
    "Measured as the mean response length over the last quarter of training (shorter = as claimed). GRPO with "
    "sequence-mean-token-mean aggregation against Dr. GRPO's constant normaliser, paired by seed.",
    {"seq_mean": ("grpo", []), "dr_grpo": ("dr_grpo", [])},
    lambda s: verdicts.decide(
        _paired(s, "seq_mean", "dr_grpo", "length_last_quarter", "length reduction of Dr. GRPO (paired)", -1),
        also=(_paired(s, "seq_mean", "dr_grpo", "final_accuracy", "accuracy gain of Dr. GRPO (paired)"),)),
    LIMITS_LM + " Addition answers are 2-4 characters: there is little room for a length bias to act.")

_lm("std_norm_nearly_solved", "Dividing by the group std hurts on mixed-difficulty prompts",
    "Both Dr. GRPO and MaxRL show that dividing advantages by \\\\sigma adds too much weight on nearly solved "
    "problems.", SEED_BLOG, "",
    "GRPO (std-normalised) against GRPO with the RLOO-style mean-only advantage on addition_mixed, paired by seed.",
    {"std_norm": ("grpo", []), "no_std": ("grpo", ["--advantage", "rloo"])},
    lambda s: verdicts.decide(_paired(s, "std_norm", "no_std", "final_accuracy",
                                      "accuracy gain without std normalisation (paired)")),
    LIMITS_LM, task="addition_mixed")

_STRESS_ARMS = {"ppo_clip": ("grpo", []), "dppo": ("dppo_tv", []), "cppo": ("cppo", []), "drpo": ("drpo", [])}
_STRESS = dict(shared=STRESS, quick=Budget(2, 15), full=Budget(5, 60), stability=True)

_lm("cppo_collapse", "CPPO cuts collapse events by 92 % under stale multi-epoch data",
    "On Qwen3-14B this gives a 3.1 point improvement on GSM8K, 2.7 on MMLU-Pro, and cuts policy collapse events "
    "during training by 92%.", SEED_OFFICE, "methods-seedblog.md section 1(c): CPPO does not clip the ratio; it "
    "masks tokens by the "
    "absolute probability shift |pi - mu| with a bound stricter early in the response (linear in relative "
    "position, a 1.25x range). The spec does not check the 92 % figure.",
    "Effect = absolute collapse-rate reduction p(PPO clip) - p(CPPO); the claimed size is 0.92 x p(PPO clip) (a "
    "92 % relative cut). Stress mode (4 epochs per batch, lr 3e-4); collapse by the lab's rule (polyrl/collapse.py).",
    _STRESS_ARMS,
    lambda s: verdicts.decide(verdicts.rate_reduction(*_count(s, "ppo_clip"), *_count(s, "cppo"),
                                                      name="collapse-rate reduction of CPPO vs PPO clip"),
                              claimed=0.92 * _count(s, "ppo_clip")[0] / _count(s, "ppo_clip")[1] or None),
    LIMITS_LM, **_STRESS)

_lm("dppo_stability", "DPPO's divergence mask collapses less than PPO clip under stale data",
    "DPPO fixed half the problem last quarter by replacing ratio clipping with absolute divergence masking.",
    SEED_DRPO, "", "Stress mode (4 epochs per batch, lr 3e-4); collapse by the lab's rule.", _STRESS_ARMS,
    lambda s: verdicts.decide(verdicts.rate_reduction(*_count(s, "ppo_clip"), *_count(s, "dppo"),
                                                      name="collapse-rate reduction of DPPO-TV vs PPO clip")),
    LIMITS_LM, **_STRESS)

_lm("drpo_steps", "DRPO reaches the accuracy threshold in 41 % fewer steps",
    "It reaches the same reward threshold in 41% fewer training steps.", SEED_DRPO,
    "methods-seedblog.md section 8(c): DRPO's penalty is quadratic in (r - 1), so its gradient weight is linear "
    "(not quadratic) in |pi - mu| and turns corrective past the boundary. The spec does not check the 41 % figure.",
    "Effect = 1 - mean steps(DRPO) / mean steps(PPO clip) to held-out accuracy 0.5 (runs that never reach it count "
    "as steps + 1), claimed 0.41. Stress mode (4 epochs per batch, lr 3e-4); threshold 0.5 held-out accuracy.",
    _STRESS_ARMS,
    lambda s: verdicts.decide(verdicts.ratio_of_means(
        _reached_steps(s, "ppo_clip"), _reached_steps(s, "drpo"), censor=_censor(s),
        name="step saving of DRPO vs PPO clip to accuracy 0.5"), claimed=0.41,
        also=(verdicts.rate_reduction(*_count(s, "ppo_clip"), *_count(s, "drpo"),
                                      name="collapse-rate reduction of DRPO"),)),
    LIMITS_LM, **_STRESS)

def _asymptote_decide(s: Samples):
    """ScaleRL asymptote A per seed (polyrl/lab/asymptote.py), paired by seed; final accuracy secondary. With fewer
    than two identified seed pairs the fits cannot decide, and final accuracy (the stand-in) is primary instead."""
    fitted = paired_asymptote(s, "dapo", "cispo", name="sigmoid asymptote A of CISPO minus DAPO (paired by seed)")
    final = _paired(s, "dapo", "cispo", "final_accuracy", "final-accuracy gain of CISPO over DAPO (paired)")
    primary, secondary = (fitted, final) if fitted.n >= 2 else (final, fitted)
    return verdicts.decide(
        primary,
        also=(secondary, paired_asymptote(s, "dapo", "gspo", name="sigmoid asymptote A of GSPO minus DAPO (paired by "
                                                                  "seed)"),
              _paired(s, "dapo", "gspo", "final_accuracy", "final-accuracy gain of GSPO over DAPO (paired)")),
        numbers={"failed_fits": failed_fits(s)})


_lm("scalerl_loss_asymptote", "CISPO and GSPO reach a higher asymptote than DAPO",
    "Among the off-policy loss functions they compare, CISPO and GSPO outperform DAPO in asymptotic performance, "
    "with CISPO selected as the default because it combines strong results with relative robustness.", SEED_BLOG,
    "", "DAPO, CISPO and GSPO. Each run (each seed) gets its own ScaleRL sigmoid fit (arXiv:2510.13786; the lab's "
    "fit_sigmoid in polyrl/lab/stats.py): held-out accuracy R against compute C = cumulative generated rollouts "
    "(counting DAPO's dynamic-sampling regenerations), R(C) = R0 + (A - R0) / (1 + (Cmid / C)^B) with R0 fixed at "
    "the run's step-0 accuracy and A bounded to [R0, 1] (polyrl/lab/asymptote.py). Effect = A(CISPO) - A(DAPO), "
    "paired by seed; A(GSPO) - A(DAPO) and the final-accuracy differences are secondary. A fit whose A sits at the "
    "bound 1 while its Cmid lies beyond the data does not identify an asymptote and counts as failed; with fewer "
    "than two identified seed pairs the final-accuracy difference decides instead. A seed "
    "whose fit fails (in either arm) is left out of that pair and counted in the effect's name; every seed's fit "
    "and its failure reason are in the results (`sigmoid_fits`). The arms table gives the share of seeds whose "
    "fitted A sits at the bound 1 (the data do not bound it) and whose half-gain compute Cmid lies beyond the "
    "last evaluation (A is then a pure extrapolation). The plot shows the mean held-out accuracy (solid, min-max band) "
    "and the mean of the per-seed fitted curves (dashed).",
    {"dapo": ("dapo", []), "cispo": ("cispo", []), "gspo": ("gspo", [])},
    _asymptote_decide,
    LIMITS_LM + " 100 steps (~6,400-8,000 rollouts) is far from an asymptote: the fitted A extrapolates the "
    "sigmoid well beyond the data (the curves are still rising), so A is sensitive to noise in the last "
    "evaluations; ScaleRL fits curves that have flattened over thousands of GPU-hours. A seed whose A sits at the "
    "bound 1 with Cmid beyond the data does not identify its asymptote and is counted as a failed fit, so the "
    "verdict never rests on an extrapolation to the bound (compare the final-accuracy rows).",
    shared=["--minibatches", "4"], per_run=seed_asymptote, post=fit_curves)

_lm("scalerl_zero_variance", "Zero-variance filtering speeds up training",
    "Instead of sampling more (as in DAPO[@dapo ], which may be optimal for number of steps), they exclude those "
    "prompts from optimization, accelerating training.", SEED_BLOG, "",
    "GRPO with and without the zero-variance group filter, paired by seed.",
    {"grpo": ("grpo", []), "zero_var": ("grpo", ["--filter", "zero_variance"]),
     "no_pos_resample": ("grpo", ["--filter", "no_positive_resampling"])},
    lambda s: verdicts.decide(_paired(s, "grpo", "zero_var", "final_accuracy",
                                      "accuracy gain of zero-variance filtering (paired)"),
                              also=(_paired(s, "grpo", "no_pos_resample", "final_accuracy",
                                            "accuracy gain of no-positive-resampling (paired)"),)),
    LIMITS_LM)

_lm("tree_budget", "Tree sampling uses the rollout budget better at equal accuracy",
    "At equal total sampling budget TRACE improves Qwen3-14B MultiHop QA accuracy by 2.8 points. Or put another "
    "way: you can get exactly the same final performance using 40% of the inference budget you were using before.",
    SEED_OFFICE, "methods-seedblog.md section 3(c): tree rollouts and spending more on boundary prefixes agree "
    "with the paper; the blog's utilisation figure is unverified and the utilisation metric is ours.",
    "Tested as utilisation (share of rollouts in groups with mixed outcomes) at equal budget, final accuracy "
    "secondary. README tree flags on addition_mixed, group size 4, 16 prompts per step.",
    {"uniform": ("grpo", []), "tree": ("grpo", ["--sampler", "tree", "--tree-predictor", "likelihood",
                                                "--tree-root-frac", "0.75", "--tree-candidates", "4"])},
    lambda s: verdicts.decide(_paired(s, "uniform", "tree", "utilization", "utilisation gain of tree sampling"),
                              also=(_paired(s, "uniform", "tree", "final_accuracy", "accuracy gain of tree"),)),
    LIMITS_LM, shared=["--group-size", "4", "--prompts-per-step", "16"], task="addition_mixed")


def _agency_arms(budget: Budget) -> dict:
    """Plain GRPO vs agency transfer whose linear hand-over ends at 2/3 of the run (67 of 100 steps, 10 of 15)."""
    return {"baseline": ("grpo", []),
            "agency": ("grpo", ["--agency", str(PACKAGE / "warmstarts" / "addition"),
                                "--agency-schedule", f"linear:steps={max(1, round(2 * budget.steps / 3))}"])}


def _worst_after_start(run: Any) -> dict[str, float]:
    """Worst held-out accuracy (acting system; learner alone) over the evaluations after step 0.

    At step 0 the learner is the warm start, i.e. the baseline itself, so a minimum that includes step 0 can never
    lie above the baseline: the comparison would be 0 (or below) by construction.
    """
    from polyrl.lab.analysis import ACC

    out = {}
    for name, key in (("worst_accuracy_after_start", ACC),
                      ("worst_learner_accuracy_after_start", "eval/learner_accuracy")):
        steps, values = run.series(key)
        values = values[steps > 0]
        out[name] = float(np.min(values)) if values.size else float("nan")
    return out


def _agency_decide(s: Samples):
    base = s["arms"]["baseline"]["accuracy_first"]
    return verdicts.decide(
        verdicts.paired_difference(base, s["arms"]["agency"]["worst_learner_accuracy_after_start"],
                                   name="worst learner accuracy after step 0 under agency transfer minus the "
                                        "baseline's"),
        also=(verdicts.paired_difference(base, s["arms"]["agency"]["worst_accuracy_after_start"],
                                         name="worst acting-system accuracy after step 0 minus the baseline's"),
              verdicts.paired_difference(base, s["arms"]["baseline"]["worst_accuracy_after_start"],
                                         name="plain GRPO's worst accuracy after step 0 minus the baseline's")))


_lm("agency_never_worse", "Agency transfer's worst evaluation is never below the baseline",
    "At no point does the policy ever perform worse than the baseline.", SEED_DRPO,
    "methods-seedblog.md section 9(c): 'starting at 100 % baseline, linearly transferring' is not confirmed by the "
    "paper (only 'progressively transferring'); 'eliminates cold start' is overstated.",
    "The frozen baseline is the warm start (`--agency polyrl/warmstarts/addition`) and its share falls linearly to "
    "0 at 2/3 of the run (`--agency-schedule linear:steps=S`, S = 67 of 100 steps full, 10 of 15 quick), so the "
    "hand-over completes within the run and the learner acts alone for the last third; against plain GRPO from "
    "the same warm start. The claim is tested on the learner's own held-out accuracy (eval/learner_accuracy): "
    "effect = its worst evaluation after step 0 minus the baseline's accuracy (the plain run's first evaluation), "
    "paired by seed; 'holds' needs the interval above 0. Step 0 is left out: there the learner is the warm start, "
    "i.e. the baseline itself. Also reported: the acting system's (baseline/learner mixture) worst evaluation after "
    "step 0, and plain GRPO's, each minus the baseline.",
    _agency_arms, _agency_decide,
    LIMITS_LM + " The baseline here is the warm start itself; a stronger, different baseline could behave otherwise.",
    per_run=_worst_after_start)

PASSK_N, PASSK_KS = 16, (1, 2, 4, 8)


def _passk(run: Any) -> dict[str, float]:
    """pass@k of the run's final policy (n = PASSK_N samples per held-out prompt, temperature 1)."""
    from polyrl.lab.passk import pass_at_k_curve, sample_counts

    curve = pass_at_k_curve(sample_counts(run.path, n=PASSK_N), PASSK_N, PASSK_KS)
    return {f"pass@{k}": v for k, v in curve.items()}


def _passk_curves(s: Samples) -> Samples:
    """The plot shows pass@k against k (mean over seeds, min-max band); the accuracy curves move aside."""
    s["accuracy_curves"] = s.pop("curves")
    s["curves"] = {}
    for arm, a in s["arms"].items():
        per_k = [a[f"pass@{k}"] for k in PASSK_KS]
        s["curves"][arm] = {"x": [float(k) for k in PASSK_KS], "y": [float(np.mean(v)) for v in per_k],
                            "lo": [float(np.min(v)) for v in per_k], "hi": [float(np.max(v)) for v in per_k],
                            "label": "pass@k (held-out, final policy)", "xlabel": "k"}
    return s


_lm("maxrl_passk", "MaxRL improves pass@k",
    "Empirically, MaxRL improves pass@k, preserves output diversity better than GRPO, and yields substantial gains "
    "in test-time scaling efficiency.", SEED_BLOG,
    "objectives-llm.md section 10: with binary rewards MaxRL's estimator (1/K) sum_i r_i grad log pi(y_i) is "
    "unbiased for the truncated objective -sum_{k=1..T} (1-p)^k / k with T = N rollouts, a harmonic mixture of the "
    "pass@1..pass@N gradients (T = 1 is standard RL); the practical form is the mean-scaled advantage "
    "(r - mean) / mean. The pass@k gain itself is the paper's empirical result (Qwen3-1.7B/4B, 16 rollouts, 1000 "
    "steps), which the spec does not check.",
    "GRPO against MaxRL, both presets as shipped (MaxRL: mean-scaled advantage, sequence token-sum, no KL; GRPO: "
    "z-score advantage, token-mean, k3 KL 0.04), 8 rollouts per prompt (MaxRL's truncation T = 8). From each run's "
    f"final checkpoint, n = {PASSK_N} samples per held-out prompt at temperature 1; pass@k for k = "
    f"{', '.join(map(str, PASSK_KS))} by the unbiased estimator 1 - C(n-c, k) / C(n, k) of Chen et al. 2021 "
    "(arXiv:2107.03374), averaged over prompts (polyrl/lab/passk.py). Effect = pass@8(MaxRL) - pass@8(GRPO), "
    "paired by seed; pass@1 and entropy over the last quarter (diversity) secondary; the plot shows pass@k "
    "against k.",
    {"grpo": ("grpo", []), "maxrl": ("maxrl", [])},
    lambda s: verdicts.decide(
        _paired(s, "grpo", "maxrl", "pass@8", "pass@8 gain of MaxRL over GRPO (paired by seed)"),
        also=(_paired(s, "grpo", "maxrl", "pass@1", "pass@1 gain of MaxRL (paired)"),
              _paired(s, "grpo", "maxrl", "entropy_last_quarter", "entropy gain of MaxRL (paired)"))),
    LIMITS_LM + " pass@k needs prompts the policy solves sometimes, not always: on 2-digit addition pass@8 is "
    "already high for both arms, so there is little room; the paper's gains are on hard maths prompts after 1000 "
    "steps.", per_run=_passk, post=_passk_curves)


def _register_family_claims() -> None:
    from polyrl.lab.claims_families import FAMILY_CLAIMS

    for claim in FAMILY_CLAIMS:
        register(claim)


_register_family_claims()
