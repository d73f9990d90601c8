"""Multi-turn tool use: the calculator task, the episode runner, masking of environment tokens, turn ratios.

The runner is driven by a scripted generator (the reply is a function of the decoded context), so a
tool call happens deterministically; one test hands the later turns to a real tiny model and checks
that the trainer's recomputed log-probs equal the sampler's with environment tokens in the context.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest
import torch

from polyrl.batch import TokenBatch
from polyrl.methods import PRESETS, get_method
from polyrl.model import completion_logprobs, load_policy
from polyrl.objectives.objective import policy_loss
from polyrl.registry import RATIOS
from polyrl.rollout import HFGenerator, SamplingParams
from polyrl.rollout.episodes import EpisodeRunner, prefix_episode
from polyrl.rollout.generator import Sample
from polyrl.tasks import AdditionTask, CalculatorTask, Prompt
from polyrl.tasks.calculator import calculate
from polyrl.tinylm import build_char_tokenizer, build_tiny_llama
from polyrl.types import LossInputs, Normalizer, group_token_counts

TOK = build_char_tokenizer()
EOS = TOK.eos_token_id


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


def calc_prompt(a: int, b: int) -> Prompt:
    return Prompt(id=f"calculator/{a}*{b}", text=f"{a}*{b}=", answer=str(a * b))


# ---------------------------------------------------------------- 1. calculate()


@pytest.mark.parametrize(
    "expression, value",
    [
        ("12*3+4", "40"),
        ("7-10", "-3"),
        ("2*3*4-30", "-6"),  # * binds tighter: 24 - 30
        ("4+6*2", "16"),
        ("10-2-3", "5"),  # left to right
        ("0", "0"),
        ("007+1", "8"),
        ("123456789*9", "1111111101"),
    ],
)
def test_calculate_hand_computed(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    "expression",
    ["", "1+", "+1", "-3", "1/2", "(1+2)", "1 + 2", "2**3", "a+1", "1234567890", "1+1+1+1+1", "1\n"],
)
def test_calculate_error(expression):
    assert calculate(expression) == "error"


# ---------------------------------------------------------------- 2. CalculatorTask


def test_respond_answers_the_call_that_ends_the_transcript():
    task, p = CalculatorTask(), calc_prompt(12, 3)
    assert task.respond(p, "<12*3>") == "36\n"
    assert task.respond(p, "let me see <2+2>") == "4\n"
    assert task.respond(p, "<2+2>4\n<3*3>") == "9\n"  # the last call, not the first
    assert task.respond(p, "<1/0>") == "error\n"
    assert task.respond(p, "12*3>") is None  # no opening bracket
    assert task.respond(p, "<12*3>x") is None  # the call does not end the transcript
    assert task.respond(p, "<1<2>") == "2\n"  # the call is the last "<...>" without brackets inside


def test_reward_reads_the_final_agent_turn():
    task, p = CalculatorTask(), calc_prompt(12, 3)
    assert task.reward(p, "<12*3>36\n36") == (1.0, {"tool_calls": 1})
    assert task.reward(p, "36") == (1.0, {"tool_calls": 0})  # right without the tool counts
    assert task.reward(p, "<12*3>36\n 36 ")[0] == 1.0
    assert task.reward(p, "<12*3>36\n35")[0] == 0.0
    assert task.reward(p, "<12*3>36\n")[0] == 0.0  # the environment's text is not the agent's answer
    assert task.reward(p, "<12*3>36\n36\n")[0] == 0.0
    assert task.reward(p, "<1*1>1\n<12*3>36\n36") == (1.0, {"tool_calls": 2})


def test_prompts_are_deterministic_disjoint_and_their_demo_is_a_transcript():
    task = CalculatorTask()
    train, test = task.prompts("train", 300, seed=0), task.prompts("test", 50, seed=0)
    assert [p.id for p in train] == [p.id for p in task.prompts("train", 300, seed=0)]
    assert not {p.text for p in train} & {p.text for p in test}
    for p in train[:50]:
        a, b = map(int, p.text[:-1].split("*"))
        assert 10 <= a < 100 and 10 <= b < 100 and p.answer == str(a * b)
        # the demo is what a perfect episode writes: call, environment reply, answer
        call = f"<{a}*{b}>"
        assert p.demo == call + task.respond(p, call) + p.answer
        assert task.reward(p, p.demo)[0] == 1.0
    assert CalculatorTask(digits=1).name == "calculator1"
    with pytest.raises(ValueError, match="digits must be >= 1, got 0"):
        CalculatorTask(digits=0)
    with pytest.raises(ValueError, match="split must be 'train' or 'test', got 'dev'"):
        task.prompts("dev", 1, seed=0)


# ---------------------------------------------------------------- 3. EpisodeRunner with a scripted generator


@dataclasses.dataclass
class ScriptedGenerator:
    """Replies with ``script(context text)`` (+ EOS when the script says so), as HFGenerator would finish it.

    Truncates to ``max_new_tokens``; finish_reason "stop" when the last token is EOS or a stop token.
    Log-probs are -0.1, -0.2, ... so their placement in the episode can be checked.
    """

    script: Callable[[str], tuple[str, bool]]
    calls: list[tuple[list[list[int]], SamplingParams]] = dataclasses.field(default_factory=list)

    def generate_ids(self, prompt_ids: list[list[int]], params: SamplingParams, keys=None) -> list[Sample]:
        self.calls.append((prompt_ids, params))
        out = []
        for index, context in enumerate(prompt_ids):
            text, eos = self.script(TOK.decode(context, skip_special_tokens=True))
            tokens = (ids(text) + [EOS] * eos)[: params.max_new_tokens]
            stop = tokens[-1] in (EOS, *params.stop_token_ids)
            out.append(Sample(prompt_index=index, prompt_token_ids=list(context), completion_token_ids=tokens,
                              logprobs=[-0.1 * (k + 1) for k in range(len(tokens))],
                              finish_reason="stop" if stop else "length", text=TOK.decode(tokens)))
        return out

    def generate(self, prompts: list[str], params: SamplingParams, keys=None) -> list[Sample]:
        raise AssertionError("the episode runner conditions on token ids")

    def load_weights(self, state_dict) -> None:
        raise AssertionError("not used")


def call_then_answer(context: str) -> tuple[str, bool]:
    """Turn 0 calls the calculator on the prompt's product; turn 1 copies the result and stops."""
    if context.endswith("="):
        return f"<{context[:-1]}>", False
    return context.rsplit("\n", 2)[-2].rsplit(">", 1)[-1], True


def test_two_turn_episode_layout():
    gen = ScriptedGenerator(call_then_answer)
    task, p = CalculatorTask(), calc_prompt(12, 3)
    runner = EpisodeRunner(gen, TOK, task)
    (s,) = runner.sample([p], SamplingParams(n=1, max_new_tokens=20, seed=0))
    agent0, env, agent1 = ids("<12*3>"), ids("36\n"), ids("36") + [EOS]
    assert s.completion_token_ids == agent0 + env + agent1
    assert s.prompt_token_ids == TOK(p.text)["input_ids"]
    assert s.loss_mask == [1] * 6 + [0] * 3 + [1] * 3
    assert s.logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5, -0.6, 0, 0, 0, -0.1, -0.2, -0.3])
    assert s.turn_ids == [0] * 9 + [1] * 3  # environment tokens carry the turn that called the tool
    assert s.finish_reason == "stop" and s.text == "<12*3>36\n36"
    assert task.reward(p, s.text)[0] == 1.0
    # what the generator was asked: the tool's stop token, one completion, the budget left
    (first, first_params), (second, second_params) = gen.calls
    assert first == [s.prompt_token_ids] and first_params.stop_token_ids == tuple(ids(">"))
    assert first_params.n == 1 and first_params.max_new_tokens == 20
    assert second == [s.prompt_token_ids + agent0 + env]
    assert second_params.max_new_tokens == 20 - 9 and second_params.stop_token_ids == tuple(ids(">"))


def test_the_length_cap_counts_environment_tokens():
    task, p = CalculatorTask(), calc_prompt(12, 3)
    # cap 8: the environment's "36\n" is cut to "36" and no agent turn follows
    gen = ScriptedGenerator(call_then_answer)
    (s,) = EpisodeRunner(gen, TOK, task).sample([p], SamplingParams(n=1, max_new_tokens=8, seed=0))
    assert s.completion_token_ids == ids("<12*3>36") and s.loss_mask == [1] * 6 + [0] * 2
    assert s.finish_reason == "length" and len(gen.calls) == 1
    # cap 10: one token is left for turn 1
    gen = ScriptedGenerator(call_then_answer)
    (s,) = EpisodeRunner(gen, TOK, task).sample([p], SamplingParams(n=1, max_new_tokens=10, seed=0))
    assert s.completion_token_ids == ids("<12*3>36\n3") and s.loss_mask == [1] * 6 + [0] * 3 + [1]
    assert s.finish_reason == "length" and gen.calls[1][1].max_new_tokens == 1
    # the cap cutting turn 0 just before its ">" means no tool call
    gen = ScriptedGenerator(call_then_answer)
    (s,) = EpisodeRunner(gen, TOK, task).sample([p], SamplingParams(n=1, max_new_tokens=5, seed=0))
    assert s.completion_token_ids == ids("<12*3") and s.loss_mask == [1] * 5 and len(gen.calls) == 1


def test_tokens_written_count_the_policys_tokens_not_the_environments():
    """rollout/useful_groups_per_token divides by the tokens the policy wrote: an environment's reply is not one
    (it was counted, so a longer product made the same episode look costlier)."""
    from polyrl.rollout.collect import collect
    from polyrl.rollout.generator import written_tokens
    from polyrl.tasks.rewards import RewardChannels

    task, p = CalculatorTask(), calc_prompt(12, 3)
    answers = iter(["36", "37"])  # one right, one wrong: a mixed group

    def script(context: str) -> tuple[str, bool]:
        return (f"<{context[:-1]}>", False) if context.endswith("=") else (next(answers), True)

    runner = EpisodeRunner(ScriptedGenerator(script), TOK, task)
    batch = collect(runner.sample, RewardChannels(task), get_method("grpo"), lambda k: [(0, p)] * k, num_groups=1,
                    params=SamplingParams(n=2, max_new_tokens=20, seed=0), history={})
    assert [s.text for s in batch.samples] == ["<12*3>36\n36", "<12*3>36\n37"]
    assert written_tokens(batch.samples) == 2 * (6 + 3) and batch.lengths.tolist() == [12, 12]  # 3 env tokens each
    assert batch.stats["rollout/useful_groups_per_token"] == pytest.approx(1 / 18)


def test_the_calculator_task_sets_its_own_length_cap_unless_one_is_given(tmp_path):
    """`polyrl train --task calculator` (the README's command) ran with the default cap of 8 tokens, in which no
    episode fits (a call is 7, its reply 3 more): every reward was 0 and no group had a gradient."""
    import argparse

    from polyrl.build import add_train_args, resolve_train

    def plan(*argv):
        parser = argparse.ArgumentParser()
        add_train_args(parser)
        return resolve_train(parser.parse_args(["--task", "calculator", *argv, "--run-dir", str(tmp_path / "x")]))

    task = CalculatorTask()
    longest = max(len(ids(p.demo)) for p in task.prompts("train", 200, 0))
    default = plan()
    assert default.cfg.max_new_tokens == task.max_new_tokens == 24 >= longest + 1  # + EOS
    assert any(n.startswith("max_new_tokens = 24: task 'calculator'") for n in default.notes)
    assert plan("--max-new-tokens", "12").cfg.max_new_tokens == 12


def test_max_turns_and_unanswerable_calls_end_the_episode():
    task, p = CalculatorTask(), calc_prompt(12, 3)
    always_call = ScriptedGenerator(lambda context: ("<1+1>", False))
    (s,) = EpisodeRunner(always_call, TOK, task).sample([p], SamplingParams(n=1, max_new_tokens=40, seed=0))
    assert task.max_turns == 3 and len(always_call.calls) == 3
    assert s.text == "<1+1>2\n<1+1>2\n<1+1>"  # no environment reply after the last allowed turn
    assert s.turn_ids == [0] * 7 + [1] * 7 + [2] * 5
    assert s.loss_mask == ([1] * 5 + [0] * 2) * 2 + [1] * 5
    no_call = ScriptedGenerator(lambda context: ("12>", False))  # ends with ">" but is no "<...>" call
    (s,) = EpisodeRunner(no_call, TOK, task).sample([p], SamplingParams(n=1, max_new_tokens=40, seed=0))
    assert s.text == "12>" and len(no_call.calls) == 1 and s.finish_reason == "stop"


def test_episodes_with_different_budgets_left_are_decoded_in_groups():
    task = CalculatorTask()
    prompts = [calc_prompt(12, 3), calc_prompt(7, 8)]
    gen = ScriptedGenerator(call_then_answer)
    samples = EpisodeRunner(gen, TOK, task).sample(prompts, SamplingParams(n=2, max_new_tokens=30, seed=0))
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1]
    assert [s.text for s in samples] == ["<12*3>36\n36"] * 2 + ["<7*8>56\n56"] * 2
    assert all(task.reward(prompts[s.prompt_index], s.text)[0] == 1.0 for s in samples)
    # turn 0 together; turn 1 in two groups (budgets 30 - 9 and 30 - 8 left), smaller budget first
    assert [(len(c), p.max_new_tokens) for c, p in gen.calls] == [(4, 30), (2, 21), (2, 22)]
    assert len({p.seed for _, p in gen.calls}) == 3  # each decode call gets its own seed


def continue_episodes(gen, task, episodes, max_new_tokens: int = 20) -> list[Sample]:
    runner = EpisodeRunner(gen, TOK, task)
    return runner.to_samples(runner.run(episodes, SamplingParams(max_new_tokens=max_new_tokens, seed=0)),
                             [0] * len(episodes))


def test_a_prefix_continues_as_context_in_the_right_turn():
    task, p = CalculatorTask(), calc_prompt(12, 3)
    runner = EpisodeRunner(ScriptedGenerator(call_then_answer), TOK, task)
    (root,) = runner.run(runner.new([p], 1), SamplingParams(max_new_tokens=20, seed=0))
    # after the environment's reply: the next agent turn is turn 1; the copied tokens are context only
    branch = prefix_episode(root, 9)
    assert branch.turn == 1 and not branch.done and branch.loss_mask == [0] * 9
    gen = ScriptedGenerator(lambda context: ("37", True))
    (s,) = continue_episodes(gen, task, [branch])
    assert s.text == "<12*3>36\n37" and s.loss_mask == [0] * 9 + [1] * 3 and s.turn_ids == [0] * 9 + [1] * 3
    assert s.logprobs[:9] == root.logprobs[:9] and gen.calls[0][0] == [root.prompt_ids + root.token_ids[:9]]
    assert gen.calls[0][1].max_new_tokens == 11
    # inside turn 0: the continuation finishes turn 0, then the environment answers its call
    branch = prefix_episode(root, 3)
    assert branch.turn == 0 and branch.token_ids == ids("<12")
    gen = ScriptedGenerator(lambda context: ("*3>", False) if context.endswith("<12") else ("36", True))
    (s,) = continue_episodes(gen, task, [branch])
    assert s.text == "<12*3>36\n36" and s.loss_mask == [0] * 3 + [1] * 3 + [0] * 3 + [1] * 3
    assert s.turn_ids == [0] * 9 + [1] * 3
    assert prefix_episode(root, 0).turn == 0


def test_plain_tasks_run_single_turn():
    gen = ScriptedGenerator(lambda context: ("4>5", True))
    prompt = Prompt(id="addition/1+3", text="1+3=", answer="4")
    (s,) = EpisodeRunner(gen, TOK, AdditionTask()).sample([prompt], SamplingParams(n=1, max_new_tokens=10, seed=0))
    assert s.completion_token_ids == ids("4>5") + [EOS] and s.loss_mask == [1] * 4 and s.turn_ids == [0] * 4
    assert gen.calls[0][1].stop_token_ids == ()  # ">" is an ordinary token here


def test_a_sentencepiece_style_tokenizer_stops_on_the_call_and_keeps_the_reply_s_spelling():
    """A Metaspace tokenizer (Llama 2, Mistral) writes ">" alone as "▁>", another token than the ">" that closes
    "<37*58>" in a transcript: the tool was never called. And the reply encoded alone started with a word marker,
    so the transcript read "<37*58> 2146"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [f"{a}*{b}= <{a}*{b}>{a * b}\n{a * b} and a > b" for a in range(10, 60) for b in range(10, 40)]
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    core.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    core.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>",
                                                                                         "<unk>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>")
    call = tok("37*58= <37*58>", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(tok(">", add_special_tokens=False)["input_ids"]) == ["\u2581>"]
    runner = EpisodeRunner(ScriptedGenerator(call_then_answer), tok, CalculatorTask())
    assert call[-1] in runner.stop_ids and tok.convert_ids_to_tokens(call[-1]) == ">"
    model_call = tok("<37*58>", add_special_tokens=False)["input_ids"]
    assert tok.decode(model_call + runner._reply_ids("2146\n")) == "<37*58>2146\n"


def test_tool_stop_must_be_one_token():
    task = CalculatorTask()
    task.tool_stop = "=>"
    with pytest.raises(ValueError, match="tool_stop = '=>' must be one token of the tokenizer, got 2 tokens"):
        EpisodeRunner(ScriptedGenerator(call_then_answer), TOK, task)


# ---------------------------------------------------------------- real model: the sampler's context is the trainer's


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    path = build_tiny_llama(tmp_path_factory.mktemp("tiny"), hidden=32, layers=1, heads=2, seed=0)
    model, tokenizer = load_policy(path, threads=torch.get_num_threads())
    with torch.no_grad():  # peaked distributions, EOS likely enough to end some turns
        gen = torch.Generator().manual_seed(3)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
        model.lm_head.weight[tokenizer.eos_token_id] *= 2.5
    return model, tokenizer


@dataclasses.dataclass
class ScriptedFirstTurn:
    """Turn 0 is the scripted tool call; every later turn is sampled by a real HFGenerator."""

    real: HFGenerator

    def generate_ids(self, prompt_ids: list[list[int]], params: SamplingParams, keys=None) -> list[Sample]:
        if all(TOK.decode(c, skip_special_tokens=True).endswith("=") for c in prompt_ids):
            return ScriptedGenerator(call_then_answer).generate_ids(prompt_ids, params)
        return self.real.generate_ids(prompt_ids, params, keys)


def test_rollout_logprobs_after_the_environment_match_the_trainer(policy):
    model, tokenizer = policy
    runner = EpisodeRunner(ScriptedFirstTurn(HFGenerator(model, tokenizer)), tokenizer, CalculatorTask())
    prompts = [calc_prompt(12, 3), calc_prompt(45, 67)]
    samples = runner.sample(prompts, SamplingParams(n=3, max_new_tokens=24, seed=1))
    tb = TokenBatch.from_samples(samples, tokenizer.pad_token_id)
    for i, s in enumerate(samples):
        c = len(s.completion_token_ids)
        assert tb.loss_mask[i, :c].tolist() == s.loss_mask and tb.turn_ids[i, :c].tolist() == s.turn_ids
        assert tb.loss_mask[i, c:].sum() == 0 and tb.completion_mask[i, :c].sum() == c
    with torch.no_grad():
        scored = completion_logprobs(model, tb.input_ids, tb.attention_mask, tb.completion_mask)
    later = (tb.loss_mask > 0) & (tb.turn_ids >= 1)  # tokens the real model chose after the environment spoke
    assert int(later.sum()) >= 20
    torch.testing.assert_close(scored.logp[later], tb.rollout_logp[later], atol=2e-5, rtol=0)
    env = (tb.completion_mask > 0) & (tb.loss_mask == 0)
    assert int(env.sum()) >= 3 * len("36\n") + 3 * len("3015\n") and bool((tb.rollout_logp[env] == 0).all())


# ---------------------------------------------------------------- 4. environment tokens get no gradient


def _multi_turn_samples() -> list[Sample]:
    """Four episodes of one prompt: right, wrong and cut-short answers after a tool call."""
    answers = iter([("36", True), ("35", True), ("3", False), ("360", True)])

    def script(context: str) -> tuple[str, bool]:
        return call_then_answer(context) if context.endswith("=") else next(answers)

    runner = EpisodeRunner(ScriptedGenerator(script), TOK, CalculatorTask())
    return runner.sample([calc_prompt(12, 3)], SamplingParams(n=4, max_new_tokens=20, seed=0))


def _loss_inputs(tb: TokenBatch, seed: int = 0) -> LossInputs:
    g = torch.Generator().manual_seed(seed)
    B, T = tb.loss_mask.shape
    mask = tb.loss_mask.double()
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.1  # recomputed: env tokens have one too
    # ratios within 1e-5 of 1, inside every trust region (GSPO's band is 3e-4 wide)
    logp = (old + 1e-5 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_(True)
    rollout = torch.where(mask > 0, old + 1e-5 * torch.randn(B, T, generator=g, dtype=torch.float64), 0.0)
    group_ids = torch.zeros(B, dtype=torch.long)
    return LossInputs(
        logp=logp, old_logp=old, rollout_logp=rollout,  # the sampler reports 0 at environment tokens
        ref_logp=old + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64),
        adv=torch.tensor([1.5, -0.5, -1.0, 0.7], dtype=torch.float64)[:, None].expand(B, T).clone(),
        mask=mask, normalizer=Normalizer.from_batch(mask, group_ids, horizon=T),
        entropy=torch.rand(B, T, generator=g, dtype=torch.float64), group_ids=group_ids,
        group_tokens=group_token_counts(mask, group_ids), segment_ids=torch.zeros(B, T, dtype=torch.long),
        turn_ids=tb.turn_ids,
    )


NO_TOPK = [name for name in PRESETS if not get_method(name).needs_topk]


@pytest.mark.parametrize("name", NO_TOPK)
def test_environment_tokens_get_no_gradient(name):
    samples = _multi_turn_samples()
    assert [s.text for s in samples] == ["<12*3>36\n36", "<12*3>36\n35", "<12*3>36\n3", "<12*3>36\n360"]
    tb = TokenBatch.from_samples(samples, TOK.pad_token_id)
    inp = _loss_inputs(tb)
    out = policy_loss(inp, get_method(name))
    (grad,) = torch.autograd.grad(out.loss, inp.logp)
    env = (tb.completion_mask > 0) & (tb.loss_mask == 0)
    agent = tb.loss_mask > 0
    assert int(env.sum()) == 4 * 3
    assert bool((grad[env] == 0).all()), f"{name}: environment tokens got gradient {grad[env]}"
    assert bool((grad[tb.completion_mask == 0] == 0).all())
    method = get_method(name)
    # The 80/20 token mask keeps ceil(rho * n) agent tokens by design (the environment tokens are never candidates).
    kept = math.ceil(method.entropy_top * int(agent.sum())) if method.entropy_top else int(agent.sum())
    assert int((grad[agent] != 0).sum()) >= kept - 2, f"{name}: agent tokens lost their gradient"


def test_environment_token_ids_do_not_change_the_model_gradient(policy):
    """With environment tokens last (the cap cut the reply), their ids affect nothing the loss sees."""
    model, tokenizer = policy
    gen = ScriptedGenerator(call_then_answer)
    (s,) = EpisodeRunner(gen, TOK, CalculatorTask()).sample([calc_prompt(12, 3)], SamplingParams(max_new_tokens=8))
    assert s.loss_mask == [1] * 6 + [0] * 2
    other = dataclasses.replace(s, completion_token_ids=s.completion_token_ids[:6] + ids("9a"))
    method = get_method("grpo", kl="none", kl_coef=0.0)

    def grads(sample: Sample, mask_env: bool) -> list[torch.Tensor]:
        tb = TokenBatch.from_samples([sample], tokenizer.pad_token_id)
        model.zero_grad(set_to_none=True)
        cur = completion_logprobs(model, tb.input_ids, tb.attention_mask, tb.completion_mask)
        mask = tb.loss_mask if mask_env else tb.completion_mask
        old = cur.logp.detach() - 0.01
        group_ids = torch.zeros(1, dtype=torch.long)
        inp = LossInputs(logp=cur.logp, old_logp=old, adv=torch.tensor([1.0]), mask=mask,
                         normalizer=Normalizer.from_batch(mask, group_ids), turn_ids=tb.turn_ids)
        policy_loss(inp, method).loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    for a, b in zip(grads(s, True), grads(other, True), strict=True):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=0)
    # control: were the environment tokens in the loss, their ids would matter
    differ = [not torch.allclose(a, b, atol=1e-7, rtol=0) for a, b in zip(grads(s, False), grads(other, False))]
    assert any(differ)


# ---------------------------------------------------------------- 5. turn ratios


def _ratio_inputs():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(2, 9, generator=g, dtype=torch.float64) * 2
    old = logp + 0.3 * torch.randn(2, 9, generator=g, dtype=torch.float64)
    # row 0: turn 0 (3 agent + 2 env), turn 1 (2 agent), padding; row 1: turns 0, 1 (1 env), 2
    mask = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 0, 0], [1, 1, 0, 1, 1, 1, 0, 1, 1]], dtype=torch.float64)
    turns = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1, 1, 2, 2]])
    return logp, old, mask, turns


def test_turn_ratio_is_the_geometric_mean_of_its_agent_tokens():
    logp, old, mask, turns = _ratio_inputs()
    logp = logp.clone().requires_grad_(True)
    log_ratio = RATIOS.fn("turn")(logp, old, mask, None, turns)
    values = log_ratio.detach()
    token_ratio = (logp - old).detach().exp()
    for b in range(2):
        for k in set(turns[b].tolist()):
            members = [t for t in range(9) if turns[b, t] == k and mask[b, t] > 0]
            if not members:
                continue
            geo = math.prod(float(token_ratio[b, t]) for t in members) ** (1 / len(members))
            for t in members:
                assert math.exp(float(values[b, t])) == pytest.approx(geo, rel=1e-12)
    # the gradient stays per token: d log r_k / d logp_s = 1/|turn k| for agent tokens s of turn k, else 0
    (row,) = torch.autograd.grad(log_ratio[1, 3], logp)
    want = torch.zeros_like(row)
    want[1, [3, 4, 5]] = 1 / 3  # turn 1 of row 1: agent tokens 3, 4, 5; environment token 6 excluded
    torch.testing.assert_close(row, want)


def test_environment_tokens_do_not_enter_the_turn_ratio():
    logp, old, mask, turns = _ratio_inputs()
    base = RATIOS.fn("turn")(logp, old, mask, None, turns)
    env = mask == 0
    moved = RATIOS.fn("turn")(torch.where(env, logp - 5.0, logp), torch.where(env, old + 3.0, old), mask, None, turns)
    torch.testing.assert_close(moved[~env], base[~env], rtol=0, atol=1e-12)


def test_turn_ratio_limits_are_the_sequence_and_token_ratios():
    logp, old, mask, _ = _ratio_inputs()
    one_turn = torch.zeros(2, 9, dtype=torch.long)
    agent = mask > 0
    seq = RATIOS.fn("sequence")(logp, old, mask, None, None)
    torch.testing.assert_close(RATIOS.fn("turn")(logp, old, mask, None, one_turn)[agent], seq[agent])
    per_token = torch.arange(9)[None, :].expand(2, 9)
    tok = RATIOS.fn("token")(logp, old, mask, None, None)
    torch.testing.assert_close(RATIOS.fn("turn")(logp, old, mask, None, per_token)[agent], tok[agent])


def test_turn_ratio_needs_turn_ids():
    logp, old, mask, _ = _ratio_inputs()
    with pytest.raises(ValueError, match="ratio 'turn' needs LossInputs.turn_ids"):
        RATIOS.fn("turn")(logp, old, mask, None, None)
