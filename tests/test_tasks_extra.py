"""Countdown, math word problems from local files, and reward functions by import path."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from polyrl.tasks.countdown import CountdownError, CountdownTask, evaluate_expression
from polyrl.tasks.math import MathTask
from polyrl.tasks.rewards import RewardChannels, load_callable


def test_countdown_checker_accepts_any_valid_expression():
    assert evaluate_expression("(25-7)*3", [3, 7, 25]) == 54
    assert evaluate_expression("25/(7-3)", [3, 7, 25]) == Fraction(25, 4)
    for bad, why in [("25+25", "not available"), ("3+8", "not available"), ("2**3", "only integers"),
                     ("7/(3-3)", "division by zero"), ("3+", "not an arithmetic")]:
        with pytest.raises(CountdownError, match=why):
            evaluate_expression(bad, [3, 7, 25, 2] if "**" in bad else [3, 7, 25])
    with pytest.raises(CountdownError, match="every number"):
        evaluate_expression("3+7", [3, 7, 25], use_all=True)
    # deep nesting made the parser or the evaluator raise RecursionError / MemoryError, which stopped training
    for deep in ("-" * 1000 + "5", "1+" * 1000 + "1", "-" * 100_000, "(" * 300 + "3" + ")" * 300):
        with pytest.raises(CountdownError):
            evaluate_expression(deep, [3, 7, 25])
    task = CountdownTask()
    assert task.reward(task.prompts("train", 1, seed=0)[0], "1+" * 1000 + "1")[0] == 0.0


def test_countdown_prompts_are_solvable_deterministic_and_disjoint():
    task = CountdownTask()
    train, test = task.prompts("train", 200, seed=1), task.prompts("test", 50, seed=1)
    assert [p.id for p in train] == [p.id for p in task.prompts("train", 200, seed=1)]
    assert not {p.id for p in train} & {p.id for p in test}
    # every target is reachable: brute force over expressions of two numbers or all three
    import itertools

    def reachable(nums, target):
        frontier = [[(Fraction(n), str(n)) for n in nums]]
        while frontier:
            pool = frontier.pop()
            if any(v == target for v, _ in pool):
                return True
            for (i, a), (j, b) in itertools.permutations(enumerate(pool), 2):
                rest = [x for k, x in enumerate(pool) if k not in (i, j)]
                for v, e in ((a[0] + b[0], "+"), (a[0] - b[0], "-"), (a[0] * b[0], "*")) + (
                        ((a[0] / b[0], "/"),) if b[0] else ()):
                    frontier.append(rest + [(v, e)])
        return False

    for p in train[:30]:
        nums = [int(x) for x in p.text.split(":")[0].split()]
        assert reachable(nums, Fraction(int(p.answer))), p.text


def test_the_held_out_prompts_are_as_many_distinct_ones_as_asked():
    """Countdown draws a prompt twice now and then: 200 asked gave 199 distinct ones, and the build said the split
    held no more. Repeats are dropped and more drawn."""
    from polyrl.tasks.base import held_out_prompts

    for n in (200, 1000):
        got = held_out_prompts(CountdownTask(), n)
        assert len(got) == n == len({p.id for p in got})
    assert held_out_prompts(CountdownTask(), 200) == held_out_prompts(CountdownTask(), 200)


def test_countdown_reward():
    task = CountdownTask()
    p = task.prompts("train", 1, seed=0)[0]
    assert task.reward(p, "")[0] == 0.0
    nums = [int(x) for x in p.text.split(":")[0].split()]
    assert task.reward(p, "+".join(map(str, nums)))[0] == float(sum(nums) == int(p.answer))


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_math_task_from_jsonl_and_parquet(tmp_path):
    rows = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(60)]
    rows.append({"question": "Half of one?", "answer": "\\frac{1}{2}"})
    _write_jsonl(tmp_path / "m.jsonl", rows)
    task = MathTask(str(tmp_path / "m.jsonl"))
    train, test = task.prompts("train", 40, 0), task.prompts("test", 3, 0)
    assert not {p.id for p in train} & {p.id for p in test}
    half = MathTask(str(tmp_path / "m.jsonl"), heldout_percent=0)
    p = next(p for p in half.prompts("train", 61, 0) if "Half" in p.text)
    assert half.reward(p, "It is 0.5")[0] == 1.0
    assert half.reward(p, "It is 0.25")[0] == 0.0
    assert half.reward(p, "no idea")[0] == 0.0
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"problem": [r["question"] for r in rows], "solution": [r["answer"] for r in rows]}),
                   tmp_path / "m.parquet")
    assert len(MathTask(str(tmp_path / "m.parquet"), heldout_percent=0).prompts("train", 61, 0)) == 61


def test_math_references_in_bare_latex_or_json_floats_are_read_whole(tmp_path):
    """An answer column holds bare LaTeX (math-verify reads LaTeX only inside $...$ or \\boxed{}: 2\\sqrt{3} was 2
    and \\sqrt{2} nothing), JSON numbers (1e-05 was the string '1e-05', read as 1) and units (wrapped as they are,
    "5 dollars" is the product 5*d*o*l*l*a*r*s)."""
    rows = [{"question": q, "answer": a} for q, a in [
        ("root two?", "\\sqrt{2}"), ("two root three?", "2\\sqrt{3}"), ("ten to the ten?", "10^{10}"),
        ("three quarters?", "\\dfrac{3}{4}"), ("small?", 1e-05), ("big?", 1.5e20), ("boxed?", "\\boxed{7}"),
        ("cost?", "5 dollars"), ("half?", "\\frac{1}{2} hours"), ("algebra?", "x^2 + 2xy"), ("trig?", "2 sin x")]]
    _write_jsonl(tmp_path / "m.jsonl", rows)
    task = MathTask(str(tmp_path / "m.jsonl"), heldout_percent=0)
    by_q = {p.text.split("\n")[0]: p for p in task.prompts("train", len(rows), 0)}

    def reward(question, completion):
        return task.reward(next(p for t, p in by_q.items() if question in t), completion)[0]

    assert reward("root two?", "\\boxed{\\sqrt{2}}") == 1.0
    assert reward("two root three?", "2") == 0.0 and reward("two root three?", "\\boxed{2\\sqrt{3}}") == 1.0
    assert reward("ten to the ten?", "10") == 0.0 and reward("ten to the ten?", "\\boxed{10^{10}}") == 1.0
    assert reward("three quarters?", "0.75") == 1.0
    assert reward("small?", "0.00001") == 1.0 and reward("small?", "1") == 0.0
    assert reward("big?", "150000000000000000000") == 1.0 and reward("big?", "1.5") == 0.0
    assert reward("boxed?", "7") == 1.0
    assert reward("cost?", "\\boxed{5}") == 1.0 and reward("cost?", "\\boxed{6}") == 0.0
    assert reward("half?", "\\boxed{\\frac{1}{2}}") == 1.0 and reward("half?", "\\boxed{2}") == 0.0
    assert reward("cost?", "5 dollars") == 1.0  # the reference read whole matches too
    # letters right after a digit are algebra, and a math word is no unit: neither is cut off the value
    assert reward("algebra?", "\\boxed{x^2+2xy}") == 1.0 and reward("algebra?", "\\boxed{x^2 + 2}") == 0.0
    assert reward("trig?", "\\boxed{2}") == 0.0


def test_a_short_bare_answer_is_graded_whole_like_the_reference(tmp_path):
    """After "Answer: " a policy writes its answer bare; math-verify reads LaTeX only inside $...$ or \\boxed{}, so
    "2\\sqrt{3}" was read as 2 and a letter or a word as nothing: exactly the reference scored 0. A reference
    "1e-05" given as text was read as 1 * e - 5."""
    rows = [{"question": q, "answer": a} for q, a in [("root?", "2\\sqrt{3}"), ("letter?", "B"),
                                                      ("city?", "Paris"), ("small?", "1e-05")]]
    _write_jsonl(tmp_path / "m.jsonl", rows)
    task = MathTask(str(tmp_path / "m.jsonl"), heldout_percent=0)
    by_q = {p.text.split("\n")[0]: p for p in task.prompts("train", len(rows), 0)}

    def reward(question, completion):
        return task.reward(by_q[question], completion)[0]

    assert reward("root?", "2\\sqrt{3}") == 1.0 and reward("root?", "2") == 0.0 and reward("root?", "3\\sqrt{2}") == 0.0
    assert reward("letter?", "B") == 1.0 and reward("letter?", "C") == 0.0 and reward("letter?", "\\boxed{B}") == 1.0
    assert reward("city?", "Paris") == 1.0 and reward("city?", "Rome") == 0.0 and reward("city?", "paris") == 1.0
    assert reward("city?", "Psari") == 0.0  # as maths a word is a product of letters: an anagram matched
    assert reward("small?", "0.00001") == 1.0 and reward("small?", "1") == 0.0
    assert reward("root?", "The answer is " + "very " * 20 + "2\\sqrt{3}") == 0.0  # long prose is not read whole


def test_near_duplicate_questions_share_a_split(tmp_path):
    """The split hashed the raw question: copies differing in whitespace, or in a conversation's system message,
    fell on both sides, so held-out questions were trained on."""
    rows = []
    for i in range(300):
        rows += [{"question": f"What is {i} + {i}?", "answer": str(2 * i)},
                 {"question": f"What  is {i} + {i}?\n", "answer": str(2 * i)},
                 {"question": [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": f"What is {i} + {i}?"}], "answer": str(2 * i)},
                 {"question": [{"role": "system", "content": "Think."},
                               {"role": "user", "content": f"What is {i} + {i}?"}], "answer": str(2 * i)}]
    _write_jsonl(tmp_path / "m.jsonl", rows)
    task = MathTask(str(tmp_path / "m.jsonl"), heldout_percent=20)

    def users(split):
        return {" ".join((p.messages[-1][1] if p.messages else p.text.split("\n")[0]).split())
                for p in task._pools[split]}

    assert users("train") & users("test") == set()
    assert 0.1 < len(users("test")) / 300 < 0.3


def test_a_json_file_of_one_object_is_told_what_a_json_file_holds(tmp_path):
    from polyrl.tasks.math import DataFileError

    (tmp_path / "m.json").write_text(json.dumps({"data": [{"question": "1+1?", "answer": "2"}]}, indent=2))
    with pytest.raises(DataFileError, match=r"holds one JSON object; a .json file must hold one array of objects"):
        MathTask(str(tmp_path / "m.json"), heldout_percent=0)


def test_a_lone_surrogate_is_refused_naming_its_row(tmp_path):
    from polyrl.tasks.math import DataFileError

    (tmp_path / "m.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n{"question": "\\ud800?", "answer": "2"}\n')
    with pytest.raises(DataFileError, match=r"row 2 \(line 2\) has a lone surrogate escape in 'question'"):
        MathTask(str(tmp_path / "m.jsonl"), heldout_percent=0)


def test_math_task_names_a_missing_column(tmp_path):
    _write_jsonl(tmp_path / "bad.jsonl", [{"question": "1+1?", "result": "2"}])
    with pytest.raises(ValueError, match=r"no answer column .*its columns: question, result"):
        MathTask(str(tmp_path / "bad.jsonl"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        MathTask(str(tmp_path / "none.jsonl"))


def test_reward_functions_by_import_path_and_channels(tmp_path):
    (tmp_path / "my_rewards.py").write_text(
        "def short(prompts, completions, **kw):\n    return [1.0 if len(c) < 3 else 0.0 for c in completions]\n")
    fn = load_callable(f"{tmp_path / 'my_rewards.py'}:short")
    assert fn(prompts=["a"], completions=["xy"]) == [1.0]
    task = CountdownTask()
    rewards = RewardChannels(task, ["task", f"{tmp_path / 'my_rewards.py'}:short"], [1.0, 0.5])
    p = task.prompts("train", 1, 0)[0]
    out = rewards([p], ["1"])
    assert out.channels[0][1] == 1.0 and out.total[0] == pytest.approx(out.channels[0][0] + 0.5)
    for bad, why in [("nomodule_xyz:f", "cannot import"), ("polyrl.tasks:nothing", "no callable"), ("f", "write it")]:
        with pytest.raises(ValueError, match=why):
            load_callable(bad)


def test_a_reward_function_that_cannot_be_called_so_is_refused_as_it_loads(tmp_path):
    """A wrong signature (or an async def) was found only after the model loaded and the first evaluation ran; a
    multi-line exception message printed several lines; an empty --reward-funcs meant the default silently."""
    from polyrl.errors import RewardError
    from polyrl.tasks.rewards import parse_reward_specs

    (tmp_path / "rf.py").write_text(
        "def two(prompts, completions):\n    return [0.0] * len(completions)\n"
        "async def later(prompts, completions, **kw):\n    return [0.0] * len(completions)\n"
        "def loud(prompts, completions, **kw):\n    raise ValueError('line one\\nline two')\n")
    with pytest.raises(ValueError, match=r"rf.py:two' cannot be called as fn\(prompts=..., completions=..., "
                                         r"answers=...\) \(got an unexpected keyword argument 'answers'\)"):
        load_callable(f"{tmp_path / 'rf.py'}:two")
    with pytest.raises(ValueError, match="is async"):
        load_callable(f"{tmp_path / 'rf.py'}:later")
    task = CountdownTask()
    with pytest.raises(RewardError) as e:
        RewardChannels(task, [f"{tmp_path / 'rf.py'}:loud"])(task.prompts("train", 1, 0), ["1"])
    assert "raised ValueError: line one" in str(e.value) and "line two" not in str(e.value)
    for funcs, weights, field in (("", None, "reward_funcs = ''"), (None, " ", "reward_weights = ' '")):
        with pytest.raises(ValueError, match=field):
            parse_reward_specs(funcs, weights)


def test_a_data_file_with_characters_the_tokenizer_lacks_is_refused_before_the_first_step(tiny_model, tmp_path,
                                                                                         capsys):
    """A character tokenizer (the warm starts') reads a character it has no token for as <unk>: the run trained on
    prompts it could not see, silently."""
    from polyrl.cli import main

    rows = [{"question": f"{i}+1 in euros?" + (" 2€" if i == 5 else ""), "answer": str(i + 1)} for i in range(40)]
    _write_jsonl(tmp_path / "d.jsonl", rows)
    argv = ["train", "--model", tiny_model, "--task", "math", "--data-file", str(tmp_path / "d.jsonl"), "--steps",
            "1", "--prompts-per-step", "2", "--group-size", "2", "--eval-prompts", "2", "--threads", "1",
            "--heldout-percent", "10", "--no-tensorboard", "--run-dir", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "data_file: 1 of its" in err and "hold characters the tokenizer has no token for" in err, err
    assert "'€'" in err and len(err.splitlines()) == 1


def test_an_unk_that_is_also_bos_or_eos_is_not_read_as_unknown_text():
    """GPT-2-style tokenizers name <|endoftext|> (their BOS and EOS) as unk: every prompt holding a BOS was refused."""
    from types import SimpleNamespace

    from polyrl.tasks.chat import own_unk_id

    assert own_unk_id(SimpleNamespace(unk_token_id=3, bos_token_id=1, eos_token_id=2, pad_token_id=0)) == 3
    assert own_unk_id(SimpleNamespace(unk_token_id=1, bos_token_id=1, eos_token_id=2, pad_token_id=0)) is None
    assert own_unk_id(SimpleNamespace(unk_token_id=None, bos_token_id=1, eos_token_id=2, pad_token_id=0)) is None
