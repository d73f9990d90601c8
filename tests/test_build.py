"""The builder refuses every setting that would have no effect, and the settings it accepts reach the maths."""

from __future__ import annotations

import argparse
import io
import json

import pytest
import torch
from rich.console import Console

from polyrl.build import add_train_args, resolve_train
from polyrl.config import ConfigError, TrainConfig, build_config, load_toml, settings, validate
from polyrl.methods import get_method
from polyrl.objectives.group_layout import advantages
from polyrl.rollout.collect import RolloutBatch
from polyrl.tasks.arithmetic import AdditionTask
from polyrl.trainer import train
from polyrl.types import TreeInfo

QUIET = Console(file=io.StringIO(), width=120)


def _resolve(argv, tmp_path):
    parser = argparse.ArgumentParser()
    add_train_args(parser)
    args = parser.parse_args([*argv, "--run-dir", str(tmp_path / "never-written")])
    return resolve_train(args)


# Every field whose effect depends on another setting: (field, a non-default value, flags that make it moot).
MOOT = [
    ("data_file", "{data}", []),  # addition reads no file
    ("heldout_percent", 20, []),  # no data file to split
    ("critic_lr", 1e-3, []),  # grpo has no critic
    ("value_clip", 0.2, []),
    ("value_loss_agg", "seq_mean_token_mean", []),
    ("max_gen_rounds", 2, []),  # grpo has no group filter
    ("max_gen_rounds", 2, ["--method", "dapo", "--sampler", "tree", "--filter", "none"]),  # tree: fixed budget
    ("tree_root_frac", 0.25, []),  # uniform sampler
    ("tree_candidates", 3.0, []),
    ("tree_prune", 0.1, []),
    ("tree_half_life", 5.0, []),
    ("tree_max_group", 16, []),
    ("tree_predictor", "shared", []),
    ("tree_probe", "groups", []),
    ("tree_roots", "sample", []),
    ("tree_branch", False, []),
    ("tree_half_life", 5.0, ["--sampler", "tree", "--tree-predictor", "likelihood"]),  # no history to age
    ("agency_schedule", "exp:tau=10", []),  # no baseline
    ("agency_mode", "sequence", []),
    ("guard_lr_factor", 0.25, []),  # no guard
    ("guard_max_rollbacks", 5, []),
    ("fp32_lm_head", True, []),  # float32 model
    ("ray_address", "auto", []),  # no rollout workers
    ("ray_cpus", 2, []),
    ("rollout_worker_gpus", 1.0, []),
    ("ray_cpus", 2, ["--rollout-workers", "1", "--ray-address", "auto"]),  # a cluster sizes itself
    ("system_prompt", "Be brief.", []),  # the character tokenizer has no chat template: prompts stay plain text
    ("vllm_gpu_memory_utilization", 0.5, []),  # generator hf
    ("lora_alpha", 32.0, []),  # full fine-tuning
    ("lora_targets", "q_proj,v_proj", []),
    ("lora_dropout", 0.1, []),
    ("teacher", "{data}", ["--method", "dr_grpo"]),  # no KL term whose reference the teacher could be
    ("skip_zero_adv", "yes", ["--method", "grpo"]),  # KL in the loss: zero-advantage rows keep a gradient
    ("skip_zero_adv", "yes", ["--method", "bapo"]),  # adaptive bounds over the micro-batch couple rows
    ("skip_zero_adv", "no", ["--method", "grpo"]),  # what runs anyway: nothing to skip for this method
    ("ray_cpus", 1, ["--rollout-workers", "2"]),  # less than one CPU per worker (was raised to 2 silently)
]
# Fields that always change what runs (or how the run is kept and shown).
ALWAYS = {"method", "task", "reward_funcs", "reward_weights", "model", "run_dir", "steps", "prompts_per_step",
          "group_size", "max_new_tokens", "temperature", "top_p", "top_k", "lr", "warmup_steps", "weight_decay",
          "max_grad_norm", "epochs_per_batch", "minibatches", "micro_batch_size", "train_prompts", "sampler",
          "agency", "async_staleness", "eval_every", "eval_prompts", "checkpoint_every", "resume", "resume_from",
          "overwrite", "seed", "threads", "dtype", "guard", "max_bad_steps", "log_every", "tensorboard", "wandb",
          "chat_template",
          "rollout_workers", "nproc", "device", "generator", "lora_rank", "drift_prompts",
          "preference_file", "share_prompts", "fused_adam", "micro_batch_tokens"}


def test_every_field_is_classified():
    names = {s.name for s in settings(TrainConfig)}
    assert names == ALWAYS | {m[0] for m in MOOT}, "classify the new field: MOOT (with a moot setting) or ALWAYS"


@pytest.mark.parametrize("name,value,moot", MOOT, ids=[f"{m[0]}-{i}" for i, m in enumerate(MOOT)])
def test_a_setting_without_effect_is_refused_in_one_line(tiny_model, tmp_path, name, value, moot):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(40)))
    flag = "--" + name.replace("_", "-")
    value = str(value).format(data=data)
    as_flag = [flag] if value == "True" else ["--no-" + flag[2:]] if value == "False" else [flag, value]
    with pytest.raises(ConfigError) as e:
        _resolve(["--model", tiny_model, *moot, *as_flag], tmp_path)
    assert name in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("argv", [
    ["--method", "ppo", "--critic-lr", "1e-3", "--value-clip", "0.2", "--value-loss-agg", "token_sum"],  # a critic
    ["--method", "dapo", "--max-gen-rounds", "2"],  # dynamic sampling refills
    ["--guard", "--guard-lr-factor", "0.25"],
    ["--sampler", "tree", "--tree-roots", "sample"],
    ["--method", "rloo", "--sampler", "tree"],  # KL in the reward under the tree: folded into its rewards
])
def test_the_same_settings_are_accepted_where_they_act(tiny_model, tmp_path, argv):
    _resolve(["--model", tiny_model, *argv], tmp_path)


def test_gdpo_channels_and_the_tree_are_refused_together(tiny_model, tmp_path):
    with pytest.raises(ConfigError, match="sampler = 'tree' is not allowed with advantage 'gdpo' and reward_funcs"):
        _resolve(["--model", tiny_model, "--method", "gdpo", "--sampler", "tree",
                  "--reward-funcs", "task,tests.reward_fns:digit_fraction"], tmp_path)


def test_pass_at_k_and_the_tree_are_refused_together(tiny_model, tmp_path):
    """The tree's groups have 2 to group_size rollouts; pass@k gives a group of k or fewer advantage 0 everywhere
    (a root group of 3 with rewards [1, 0, 0]: [0, 0, 0] at k = 4), so most tree groups trained on nothing."""
    with pytest.raises(ConfigError, match=r"^sampler = 'tree' is not allowed with advantage 'passk'"):
        _resolve(["--model", tiny_model, "--method", "passk", "--sampler", "tree"], tmp_path)
    _resolve(["--model", tiny_model, "--method", "passk"], tmp_path)


def test_toml_tables_name_features_and_unknown_keys_are_refused(tmp_path):
    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text('steps = 3\nsampler = "tree"\n[tree]\nroots = "sample"\nbranch = false\n')
    assert load_toml(good) == {"steps": 3, "sampler": "tree", "tree_roots": "sample", "tree_branch": False}
    bad.write_text('[tree]\nrots = "sample"\n')
    with pytest.raises(ConfigError, match=r"unknown field 'tree.rots' \(did you mean 'tree.roots'\?\)"):
        load_toml(bad)
    bad.write_text("tree = 5\n")  # it said "unknown field 'tree' (did you mean 'resume'?)"
    with pytest.raises(ConfigError, match=r"'tree' is a table; write \[tree\] with its keys \(branch, .*roots\)"):
        load_toml(bad)


def test_a_part_override_in_a_toml_file_is_refused_as_a_flag_only_setting(tmp_path, capsys):
    """`trust_region = "clip"` in --config was an unknown field whose allowed list left the part overrides out."""
    from polyrl.cli import main

    (tmp_path / "c.toml").write_text('trust_region = "clip"\n')
    assert main(["train", "--config", str(tmp_path / "c.toml"), "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "'trust_region' is a part override of the method, given as a flag only (--trust-region)" in err, err
    assert err.count("\n") == 1 and not (tmp_path / "r").exists()


def _tree_batch(rewards):
    B = len(rewards)
    tree = TreeInfo(root_ids=torch.tensor([0, 0, 1, 1]), sibling_ids=torch.full((B,), -1),
                    branch_at=torch.zeros(B, dtype=torch.long), is_root=torch.ones(B, dtype=torch.bool))
    return RolloutBatch(group_ids=torch.tensor([0, 0, 1, 1]), prompts=[], samples=[], scores=torch.tensor(rewards),
                        rewards=torch.tensor(rewards), keep=torch.ones(B, dtype=torch.bool),
                        truncated=torch.zeros(B, dtype=torch.bool), lengths=torch.full((B,), 3), tree=tree)


def test_a_kl_penalty_in_the_reward_reaches_tree_advantages():
    method = get_method("rloo")
    mask = torch.ones(4, 3)
    batch = _tree_batch([1.0, 1.0, 0.0, 1.0])
    penalty = torch.tensor([[0.0] * 3, [0.2] * 3, [0.0] * 3, [0.0] * 3], dtype=torch.float64)
    plain, _ = advantages(method, batch.rewards, batch.group_ids, mask, tree=batch.tree)
    kl, _ = advantages(method, batch.rewards, batch.group_ids, mask, token_rewards=-penalty, tree=batch.tree)
    assert plain[0, 0] == plain[1, 0] == 0  # equal rewards: no signal without the penalty
    # rloo on sequence rewards 1 and 1 - 0.6: each sample against the other
    assert kl[0, 0].item() == pytest.approx(0.6) and kl[1, 0].item() == pytest.approx(-0.6)
    assert torch.equal(kl[2:], plain[2:])  # the other group has no penalty


def test_rloo_under_the_tree_sampler_logs_its_reward_kl_penalty(tiny_model, tmp_path):
    cfg = build_config(dict(steps=2, prompts_per_step=2, group_size=4, max_new_tokens=4, eval_prompts=4,
                            eval_every=0, checkpoint_every=0, tensorboard=False, log_every=0, lr=1e-2, warmup_steps=0,
                            threads=1, sampler="tree", reward_funcs="tests.reward_fns:digit_fraction"))
    train(cfg, get_method("rloo"), model_dir=tiny_model, task=AdditionTask(), run_dir=str(tmp_path), console=QUIET)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    penalties = [r["reward/kl_penalty"] for r in rows if "reward/mean" in r]
    # The policy has moved from the reference. k1 is a sampled estimate of the KL, so its sign after one
    # small step depends on the draws: only its being nonzero is the property.
    assert len(penalties) == 2 and penalties[0] == 0.0 != penalties[1]


def test_dynamic_sampling_refills_until_its_round_limit(tiny_model, tmp_path):
    # An untrained model never solves addition: every DAPO group is all-fail and dropped, round after round.
    cfg = build_config(dict(steps=1, prompts_per_step=2, group_size=2, max_new_tokens=3, eval_prompts=4, eval_every=0,
                            checkpoint_every=0, tensorboard=False, log_every=0, threads=1, max_gen_rounds=3))
    train(cfg, get_method("dapo"), model_dir=tiny_model, task=AdditionTask(), run_dir=str(tmp_path), console=QUIET)
    row = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][1]
    assert row["rollout/gen_rounds"] == 3 and row["rollout/generated"] == 3 * 2 * 2 and row["rollout/empty_steps"] == 1


def test_a_refill_round_draws_new_random_numbers(tiny_model):
    """Round r's rows are keyed after the rows generated before it: the same prompt at the same weights sampled again
    in a refill round gives other completions (with the first round's keys it gave the very same ones)."""
    from polyrl.model import load_policy
    from polyrl.rollout.collect import NoUsableGroups, collect
    from polyrl.rollout.episodes import EpisodeRunner
    from polyrl.rollout.generator import SamplingParams
    from polyrl.rollout.hf import HFGenerator
    from polyrl.tasks.base import Prompt
    from polyrl.tasks.rewards import RewardChannels

    policy, tokenizer = load_policy(tiny_model, threads=1)
    task = AdditionTask()
    runner = EpisodeRunner(HFGenerator(policy, tokenizer), tokenizer, task)
    rounds = []

    def sample(prompts, params, key_offset):
        rounds.append((key_offset, [s.completion_token_ids for s in runner.sample(prompts, params, key_offset)]))
        return runner.sample(prompts, params, key_offset)

    same = Prompt(id="p", text="12+34=", answer="46")
    with pytest.raises(NoUsableGroups):  # never solved: every DAPO group is dropped, round after round
        collect(sample, RewardChannels(task), get_method("dapo"), lambda k: [(0, same)] * k, num_groups=2,
                params=SamplingParams(n=4, max_new_tokens=6, seed=3), history={}, max_rounds=2)
    (first, a), (second, b) = rounds
    assert (first, second) == (0, 8) and a != b
    assert runner.sample([same, same], SamplingParams(n=4, max_new_tokens=6, seed=3), 8) == \
        runner.sample([same, same], SamplingParams(n=4, max_new_tokens=6, seed=3), 8)  # keyed: reproducible


def test_feature_settings_nest_in_their_sections_and_stay_flat_as_flags_and_toml(tmp_path):
    from polyrl.guard import GuardConfig
    from polyrl.learner.config import CriticConfig
    from polyrl.rollout.agency.config import AgencyConfig
    from polyrl.rollout.source import PrefetchConfig
    from polyrl.rollout.tree.config import TreeConfig

    cfg = build_config({"tree_roots": "sample", "agency": "/x", "guard": True, "guard_lr_factor": 0.25,
                        "async_staleness": 2, "critic_lr": 1e-3, "value_clip": 0.3})
    assert cfg.tree == TreeConfig(roots="sample") and cfg.agency == AgencyConfig(baseline="/x")
    assert cfg.guard == GuardConfig(enabled=True, lr_factor=0.25) and cfg.prefetch == PrefetchConfig(staleness=2)
    assert cfg.critic == CriticConfig(lr=1e-3, value_clip=0.3)
    from polyrl.config import to_dict

    assert build_config(to_dict(cfg)) == cfg  # config.json's flat record rebuilds the same config
    toml = tmp_path / "t.toml"
    toml.write_text('[guard]\nenabled = true\n[async]\nstaleness = 1\n[critic]\nlr = 0.001\nvalue_clip = 0.2\n'
                    '[agency]\nbaseline = "/b"\nmode = "sequence"\n')
    assert load_toml(toml) == {"guard": True, "async_staleness": 1, "critic_lr": 0.001, "value_clip": 0.2,
                               "agency": "/b", "agency_mode": "sequence"}
    toml.write_text('[critic]\nclip = 0.2\n')
    with pytest.raises(ConfigError, match=r"unknown field 'critic.clip'"):
        load_toml(toml)


def test_the_likelihood_predictor_is_refused_with_custom_reward_functions(tiny_model, tmp_path):
    with pytest.raises(ConfigError, match="tree_predictor = 'likelihood' is not allowed"):
        _resolve(["--model", tiny_model, "--sampler", "tree", "--tree-predictor", "likelihood",
                  "--reward-funcs", "task,tests.reward_fns:digit_fraction"], tmp_path)
    _resolve(["--model", tiny_model, "--sampler", "tree", "--tree-predictor", "likelihood", "--reward-funcs", "task"],
             tmp_path)


@pytest.mark.parametrize("name,value,allowed", [("skip_zero_adv", True, "one of 'auto', 'yes', 'no'"),
                                                ("steps", "3", "must be int"),
                                                ("lr", float("inf"), "must be a finite number"),
                                                ("tree_candidates", float("inf"), "must be a finite number"),
                                                ("lora_dropout", float("nan"), "must be a finite number")])
def test_a_value_of_the_wrong_type_names_what_is_allowed(name, value, allowed):
    """A TOML value of the wrong type (``skip_zero_adv = true``) is refused naming the field, the value and the
    allowed values, not the annotation's repr."""
    with pytest.raises(ConfigError) as e:
        build_config({name: value})
    assert str(e.value).startswith(f"{name} = {value!r}") and allowed in str(e.value), str(e.value)


def test_tree_candidates_are_bounded():
    """--tree-candidates 1e9 grew past 5 GB drawing candidate prompts before step 1, with no line saying why."""
    validate(build_config({"sampler": "tree", "tree_candidates": 1000.0}))
    with pytest.raises(ConfigError, match=r"tree_candidates = 1000000000.0 .*must be in \[1, 1000\]"):
        validate(build_config({"sampler": "tree", "tree_candidates": 1e9}))


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_a_seed_numpy_cannot_take_is_refused_before_the_run(seed):
    """``--seed -1`` reached ``np.random.seed`` in the trainer (a traceback, and a run directory left behind)."""
    with pytest.raises(ConfigError, match=rf"seed = {seed} is not allowed; must be an integer in \[0, 2\*\*32\)"):
        validate(build_config({"seed": seed}))


@pytest.mark.parametrize("weights", ["nan", "1,inf"])
def test_reward_weights_must_be_finite(weights):
    """``--reward-weights nan`` trained to exit 0 with every reward metric dropped as non-finite and a zero loss."""
    from polyrl.tasks.rewards import parse_reward_specs

    with pytest.raises(ValueError, match=rf"reward_weights = '{weights}' must be finite numbers"):
        parse_reward_specs("task,task", weights)


@pytest.mark.parametrize("weights", ["0", "0,0.0"])
def test_reward_weights_that_are_all_zero_are_refused(weights):
    """``--reward-weights 0`` trained with every reward 0 (so every advantage 0): nothing learned, exit 0."""
    from polyrl.tasks.rewards import parse_reward_specs

    with pytest.raises(ValueError, match=rf"reward_weights = '{weights}' must not all be 0"):
        parse_reward_specs("task" if weights == "0" else "task,task", weights)
    assert parse_reward_specs("task,task", "0,1")[1] == [0.0, 1.0]  # a channel off is fine


def test_a_small_held_out_split_is_evaluated_once_per_prompt(tiny_model, tmp_path):
    """--eval-prompts above a data file's held-out split: the task cycles through the split, and greedy decoding
    scored each repeat alike, weighing some prompts more (200 of 7 prompts: 29 or 28 times each). The evaluation takes
    each once, and the run says so."""
    from polyrl.tasks.base import held_out_prompts

    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(60)))
    parser = argparse.ArgumentParser()
    add_train_args(parser)
    plan = resolve_train(parser.parse_args(["--task", "math", "--data-file", str(data), "--model", tiny_model,
                                            "--eval-prompts", "200", "--run-dir", str(tmp_path / "never")]))
    prompts = held_out_prompts(plan.task, 200)
    assert 0 < len(prompts) < 60 and len(set(prompts)) == len(prompts) == len(set(plan.task.prompts("test", 600, 0)))
    assert any(f"eval_prompts = 200: the task's held-out split gives {len(prompts)} distinct" in n for n in plan.notes)


@pytest.mark.parametrize("setting, processes, gpus, want", [
    ("auto", 1, 0, "cpu"), ("auto", 1, 1, "cuda"), ("auto", 2, 1, "cpu"), ("auto", 2, 2, "cuda"),
    ("cpu", 1, 1, "cpu"), ("cuda", 1, 1, "cuda"), ("cuda", 2, 2, "cuda"), ("cuda", 1, 0, None), ("cuda", 2, 1, None)])
def test_the_device_follows_the_gpus_torch_sees(monkeypatch, setting, processes, gpus, want):
    """auto is cuda only where every training process gets a GPU; cuda without them is refused in one line."""
    from polyrl.learner.dist import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    if want is None:
        with pytest.raises(ConfigError, match=f"^device = 'cuda' is not allowed here: .* torch sees {gpus} "):
            pick_device(setting, processes)
    else:
        assert pick_device(setting, processes).type == want


def test_device_cuda_without_a_gpu_is_refused_and_auto_stays_on_the_cpu(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="device = 'cuda' is not allowed here: it needs a CUDA GPU and torch sees 0"):
        _resolve(["--model", tiny_model, "--device", "cuda"], tmp_path)
    plan = _resolve(["--model", tiny_model], tmp_path)
    assert plan.cfg.scale.device == "auto" and not any("GPU" in n for n in plan.notes)


def test_a_resume_may_move_the_run_to_another_device(tiny_model, tmp_path, capsys):
    """The device is where a run computes, not what: a run resumes with --device cpu (a GPU run on a CPU machine),
    and its history records the change."""
    from polyrl.cli import main

    run = tmp_path / "run"
    args = ["train", "--model", tiny_model, "--steps", "1", "--prompts-per-step", "2", "--group-size", "2",
            "--eval-prompts", "2", "--run-dir", str(run), "--no-tensorboard"]
    assert main(args) == 0
    assert main([*args, "--resume", "--steps", "2", "--device", "cpu"]) == 0, capsys.readouterr().err
    history = [json.loads(line) for line in (run / "config_history.jsonl").read_text().splitlines()]
    assert history[-1]["changes"]["device"] == ["auto", "cpu"]
    assert len((run / "metrics.jsonl").read_text().splitlines()) >= 2


def test_rollout_actors_get_the_gpus_the_trainers_do_not_use(monkeypatch):
    """Training ranks on cuda use GPUs 0 .. ranks - 1 of those visible; the local Ray instance gets the rest (none
    withheld when the ranks train on the CPU: trainer_gpus 0)."""
    from polyrl.rollout.remote.pool import free_gpus

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert free_gpus(1, None) == ["1", "2", "3"]  # one process on GPU 0
    assert free_gpus(2, "3,5,6") == ["6"]  # ranks on the first two visible
    assert free_gpus(0, None) == ["0", "1", "2", "3"]


def test_rollout_actors_asking_for_gpus_the_trainer_takes_are_refused(tiny_model, tmp_path, monkeypatch):
    """One GPU, a trainer on it (auto) and an actor asking Ray for one: the actor could never be placed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    argv = ["--model", tiny_model, "--rollout-workers", "1", "--rollout-worker-gpus", "1"]
    with pytest.raises(ConfigError, match=r"^rollout_worker_gpus = 1 is not allowed here: 1 rollout actor\(s\) need "
                                          r"1 GPU\(s\), and the 1 training process\(es\) \(device = 'auto'\) take 1 "
                                          r"of this machine's 1; use --device cpu"):
        _resolve(argv, tmp_path)
    assert _resolve([*argv, "--device", "cpu"], tmp_path).cfg.scale.device == "cpu"  # the trainer leaves it free


def test_gdpo_takes_its_channel_weights_from_reward_weights(tmp_path):
    """GDPO normalises each channel's raw reward and never reads the weighted total: --reward-weights reached nothing
    (1,0.2 and 1,5 gave the same advantages). They become its own weights; conflicting weights or a shaper, which it
    would drop, are refused."""
    funcs = ["--reward-funcs", "task,tests.reward_fns:digit_fraction"]
    plan = _resolve([*funcs, "--reward-weights", "1,0.2", "--method", "gdpo"], tmp_path)
    assert plan.method.advantage.params["weights"] == "1;0.2"
    assert any("channel weights 1;0.2 from reward_weights" in n for n in plan.notes)
    channels = torch.tensor([[1.0, 0.1], [0.0, 0.9], [1.0, 0.5], [0.0, 0.2]])
    gids, mask = torch.zeros(4, dtype=torch.long), torch.ones(4, 3)
    adv = {w: advantages(_resolve([*funcs, "--reward-weights", w, "--method", "gdpo"], tmp_path).method,
                         channels[:, 0], gids, mask, channels=channels)[0][:, 0] for w in ("1,0.2", "1,5")}
    assert not torch.allclose(adv["1,0.2"], adv["1,5"])
    for extra, words in ((["--reward-weights", "1,0.2", "--advantage", "gdpo:weights=1;0.5"], "give the weights once"),
                         (["--method", "gdpo", "--shaper", "overlong_soft"], "over several reward channels")):
        with pytest.raises(ConfigError, match=words):
            _resolve([*funcs, *extra], tmp_path)


def test_build_config_refuses_a_name_that_is_no_setting():
    """The Python API ignored a misspelled flat name silently (build_config({"agency_baseline": ...}) ran no agency)."""
    with pytest.raises(ConfigError, match=r"tree_root is not a setting of TrainConfig \(did you mean 'tree_roots'\?\)"):
        build_config({"tree_root": "sample"})
    assert build_config({"tree_roots": "sample"}).tree.roots == "sample"
    assert build_config({"old_name": 1, "steps": 3}, strict=False).steps == 3  # a saved record of an older polyrl
