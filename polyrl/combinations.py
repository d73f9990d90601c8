"""Rules that span a run's settings, its method and its task: ``check_combinations`` refuses, in one line naming
both sides, a setting that another makes moot or that cannot run with it (the builder calls it once the method and
the task are resolved; the rules that need only the config live in ``config.validate``)."""

from __future__ import annotations

from polyrl.config import ConfigError, TrainConfig, flat


def check_combinations(cfg: TrainConfig, method, task):
    """Refuse, in one line naming both sides, a setting that the method, the task or another setting makes moot;
    return the device the training processes will use (``pick_device``).

    The rules that need only the config live in ``config.validate``; these also need the method or the task.
    """
    from polyrl.learner.dist import pick_device
    from polyrl.objectives.advantages import parse_channel_weights
    from polyrl.registry import ADVANTAGES, TRUST_REGIONS
    from polyrl.tasks.rewards import parse_reward_specs

    default = TrainConfig()
    adv = method.advantage.name
    where = pick_device(cfg.scale.device, cfg.scale.nproc)  # refuses cuda where torch sees too few GPUs
    _check_actor_gpus(cfg, where)
    if cfg.engine.backend == "vllm":
        import importlib.util

        import torch

        if importlib.util.find_spec("vllm") is None or not torch.cuda.is_available():
            raise ConfigError("generator = 'vllm' is not allowed here; it needs a CUDA GPU and "
                              "`pip install 'polyrl[vllm]'` (or use --generator hf)")
    if "rollout_topk" in TRUST_REGIONS.spec(method.trust_region.name).tags and (
            cfg.prefetch.staleness or cfg.engine.backend == "vllm"):
        said = f"async_staleness = {cfg.prefetch.staleness}" if cfg.prefetch.staleness else "generator = 'vllm'"
        raise ConfigError(f"{said} is not allowed with trust region {method.trust_region.name!r}: it compares the "
                          "rollout policy's top-K distribution, which only a sampler at the trainer's weights gives "
                          "(use dppo_tv or dppo_kl, which read the sampled token's rollout log-prob)")
    if method.needs_groups and cfg.group_size < 2:
        raise ConfigError(f"group_size = {cfg.group_size} is not allowed with advantage {adv!r} "
                          "(a group estimator needs >= 2 completions per prompt)")
    if cfg.sampler == "tree" and (not method.needs_groups or method.needs_values or method.filters):
        raise ConfigError(f"sampler = 'tree' needs a group advantage estimator and no group filters; method "
                          f"{method.name!r} has advantage {adv!r} and filters "
                          f"{[f.name for f in method.filters]} (try --advantage grpo --filter none)")
    specs, weights = parse_reward_specs(cfg.reward_funcs, cfg.reward_weights)
    if "channels" in ADVANTAGES.spec(adv).tags and len(specs) > 1:  # GDPO reads each channel's raw reward
        own = method.advantage.params.get("weights", "")
        if weights is not None and own and parse_channel_weights(own) != weights:
            raise ConfigError(f"reward_weights = {cfg.reward_weights!r} is not allowed with advantage {adv!r} "
                              f"weights = {own!r}: it weights the channels itself; give the weights once")
        if method.shapers:
            raise ConfigError(f"shapers {[s.name for s in method.shapers]} are not allowed with advantage {adv!r} "
                              "over several reward channels: it normalises each channel's unshaped reward (drop "
                              "--shaper, or use --advantage grpo on the weighted, shaped total)")
    if cfg.sampler == "tree" and "channels" in ADVANTAGES.spec(adv).tags and cfg.reward_funcs:
        raise ConfigError(f"sampler = 'tree' is not allowed with advantage {adv!r} and reward_funcs: tree groups "
                          "are compared on the summed reward, so its per-channel normalisation would be lost; use "
                          "--sampler uniform")
    if "needs_greedy" in ADVANTAGES.spec(adv).tags:  # ReMax: the uniform sampler decodes each prompt greedily too
        given = [(f"sampler = {cfg.sampler!r}", "'uniform'") if cfg.sampler != "uniform" else None,
                 (f"agency = {cfg.agency.baseline!r}", "none") if cfg.agency.baseline is not None else None,
                 (f"async_staleness = {cfg.prefetch.staleness}", "0") if cfg.prefetch.staleness else None,
                 (f"preference_file = {cfg.preference.file!r}", "none") if cfg.preference.file is not None else None]
        bad = next((g for g in given if g is not None), None)
        if bad is not None:
            raise ConfigError(f"{bad[0]} is not allowed with advantage {adv!r}: its baseline is the reward of a "
                              f"greedy decode at the rollout weights, which only the synchronous uniform sampler "
                              f"adds (allowed: {bad[1]})")
    if "needs_sum_pi_sq" in ADVANTAGES.spec(adv).tags:  # OTB: the in-process hf sampler records sum_v pi_v^2
        given = [(f"generator = {cfg.engine.backend!r}", "'hf'") if cfg.engine.backend == "vllm" else None,
                 (f"sampler = {cfg.sampler!r}", "'uniform'") if cfg.sampler != "uniform" else None,
                 (f"agency = {cfg.agency.baseline!r}", "none") if cfg.agency.baseline is not None else None,
                 (f"rollout_workers = {cfg.scale.rollout_workers}, async_staleness = {cfg.prefetch.staleness}",
                  "0 and 0") if cfg.scale.actors(cfg.prefetch.staleness) else None,
                 (f"preference_file = {cfg.preference.file!r}", "none") if cfg.preference.file is not None else None]
        bad = next((g for g in given if g is not None), None)
        if bad is not None:
            raise ConfigError(f"{bad[0]} is not allowed with advantage {adv!r}: it needs the sum of squared token "
                              f"probabilities that only the in-process hf uniform sampler records (allowed: {bad[1]})")
    if "k_below_group" in ADVANTAGES.spec(adv).tags and method.advantage.params["k"] >= cfg.group_size:
        raise ConfigError(f"group_size = {cfg.group_size} is not allowed with advantage {adv!r} (k = "
                          f"{method.advantage.params['k']}): pass@k needs k < group_size, else every k-subset is "
                          "the whole group and every advantage is 0")
    if "k_below_group" in ADVANTAGES.spec(adv).tags and cfg.sampler == "tree":
        raise ConfigError(f"sampler = 'tree' is not allowed with advantage {adv!r}: the tree sampler's groups (probes, "
                          "sibling continuations) have 2 to group_size rollouts, and a group of k or fewer gets pass@k "
                          "advantage 0 on every rollout (allowed: sampler 'uniform')")
    if not method.needs_values and cfg.critic != default.critic:  # name the critic setting that was given
        given, defaults = flat(cfg), flat(default)
        name = next(n for n in ("critic_lr", "value_clip", "value_loss_agg")
                    if getattr(given, n) != getattr(defaults, n))
        raise ConfigError(f"{name} = {getattr(given, name)!r} has no effect with method {method.name!r}: its "
                          f"advantage {adv!r} uses no critic (a critic preset such as ppo does)")
    if cfg.speed.skip_zero_adv != "auto" and not method.zero_adv_rows_inert:  # 'no' is what runs anyway
        raise ConfigError(f"skip_zero_adv = {cfg.speed.skip_zero_adv!r} is not allowed with method {method.name!r}: "
                          f"{method.zero_adv_rows_active()}, so rows with zero advantage always keep their backward "
                          "(allowed: 'auto')")
    if cfg.max_gen_rounds != default.max_gen_rounds and (cfg.sampler == "tree" or not method.filters):
        why = "sampler = 'tree' spends a fixed budget" if cfg.sampler == "tree" else \
            f"method {method.name!r} has no group filter that could drop a group"
        raise ConfigError(f"max_gen_rounds = {cfg.max_gen_rounds} has no effect: {why} (it bounds the refill "
                          "rounds of dynamic sampling)")
    from polyrl.rollout.preference_data import preference_problem

    problem = preference_problem(method, vars(flat(cfg)), vars(flat(default)),
                                 whole_groups="whole_groups" in TRUST_REGIONS.spec(method.trust_region.name).tags)
    if problem is not None:  # pairs inside one micro-batch; settings the offline preference source makes moot
        raise ConfigError(problem)
    if cfg.lora.rank and method.ref_sync_every:
        raise ConfigError(f"lora_rank = {cfg.lora.rank} is not allowed with method {method.name!r}: its reference "
                          f"follows the policy (every {method.ref_sync_every} steps), but a LoRA reference is the "
                          "base with the adapters off")
    from polyrl.distill import teacher_problem

    problem = teacher_problem(cfg.distill.teacher, method)
    if problem is not None:
        raise ConfigError(problem)
    filters = [f"{n} = {v!r}" for n, v, off in (("top_k", cfg.sampling.top_k, 0), ("top_p", cfg.sampling.top_p, 1.0))
               if v != off]
    if cfg.distill.teacher is not None and filters:  # the reward is log pi_T(y) - log pi_S(y), token by token
        raise ConfigError(f"{filters[0]} is not allowed with teacher = {cfg.distill.teacher!r}: the student samples "
                          "from its filtered distribution and the teacher is scored on its own, so a token outside "
                          "the teacher's kept set has no log-prob (its reward sat at the -20 clamp); sample "
                          "unfiltered (top_k 0, top_p 1)")
    if cfg.sampler == "tree" and "per_token_rewards" in ADVANTAGES.spec(adv).tags:
        raise ConfigError(f"sampler = 'tree' is not allowed with advantage {adv!r}: tree groups compare summed "
                          "sequence rewards, so its per-token (teacher) rewards would be lost; use --sampler uniform")
    custom = bool(cfg.reward_funcs) and parse_reward_specs(cfg.reward_funcs, None)[0] != ["task"]
    if cfg.sampler == "tree" and cfg.tree.predictor == "likelihood" and (custom or not getattr(task, "exact_answer",
                                                                                             False)):
        raise ConfigError(f"tree_predictor = 'likelihood' is not allowed with task = {cfg.task!r}"
                          f"{' and reward_funcs' if cfg.reward_funcs else ''}: it needs a reward that is 1 exactly "
                          "when the completion is the reference answer (addition, addition_mixed); use history or "
                          "shared")
    return where


def _check_actor_gpus(cfg: TrainConfig, where) -> None:
    """Refuse rollout actors that ask a local Ray instance for GPUs the training processes on ``where`` take (it gets
    the ones they leave: rollout/remote/pool.py), where they could never be placed."""
    if not cfg.scale.rollout_worker_gpus or cfg.scale.ray_address is not None or where.type != "cuda":
        return
    import torch

    actors = cfg.scale.actors(cfg.prefetch.staleness)
    have, need = torch.cuda.device_count() - cfg.scale.nproc, actors * cfg.scale.rollout_worker_gpus
    if need > have:
        raise ConfigError(f"rollout_worker_gpus = {cfg.scale.rollout_worker_gpus:g} is not allowed here: "
                          f"{actors} rollout actor(s) need {need:g} GPU(s), and the {cfg.scale.nproc} training "
                          f"process(es) (device = {cfg.scale.device!r}) take {cfg.scale.nproc} of this machine's "
                          f"{torch.cuda.device_count()}; use --device cpu, or fewer or smaller actors")
