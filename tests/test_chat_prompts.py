"""Prompts as chat: --chat-template renders a task's prompts (messages, system prompt, generation prompt), the ids
hold no doubled BOS, plain text is unchanged, the math task takes messages, and a tiny Qwen2 trains end to end."""

from __future__ import annotations

import argparse
import io
import json

import pytest
import torch
from rich.console import Console

from polyrl.build import add_train_args, resolve_train
from polyrl.config import ConfigError
from polyrl.rollout.episodes import EpisodeRunner
from polyrl.rollout.generator import SamplingParams
from polyrl.rollout.hf import HFGenerator
from polyrl.tasks.arithmetic import AdditionTask
from polyrl.tasks.base import Prompt
from polyrl.tasks.chat import FormattedTask, PromptFormat, formatted_task, prompt_ids
from polyrl.tasks.math import DataFileError, MathTask
from polyrl.tinyhf import END_OF_TURN, build_tiny, train_bpe_tokenizer
from polyrl.tinylm import build_tiny_llama

QUIET = Console(file=io.StringIO(), width=120)
SYSTEM = "You add numbers."


@pytest.fixture(scope="module")
def bpe():
    return train_bpe_tokenizer()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, bpe):
    """A tiny Qwen2 whose generation config stops at <eos> and at the end of a turn (<|end|>)."""
    return str(build_tiny("qwen2", tmp_path_factory.mktemp("qwen"), tokenizer=bpe, multi_eos=True))


@pytest.fixture(scope="module")
def char_model(tmp_path_factory):
    return str(build_tiny_llama(tmp_path_factory.mktemp("char"), hidden=32, layers=2, heads=2, seed=0))


def _rows(n: int = 40) -> list[dict]:
    return [{"question": f"What is {i}+{i + 1}?", "answer": str(2 * i + 1)} for i in range(n)]


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _resolve(argv, tmp_path):
    parser = argparse.ArgumentParser()
    add_train_args(parser)
    return resolve_train(parser.parse_args([*argv, "--run-dir", str(tmp_path / "never-written")]))


def test_rendering_system_user_and_generation_prompt(bpe):
    fmt = PromptFormat(bpe, "auto", SYSTEM)
    shown = fmt.apply(Prompt(id="p", text="12+34=", answer="46"))
    assert shown.rendered == f"<bos><|system|>{SYSTEM}<|end|><|user|>12+34=<|end|><|assistant|>"
    assert shown.text == "12+34=" and shown.model_text == shown.rendered  # the task's reward keeps its own text
    ids = prompt_ids(bpe, [shown])[0]
    assert ids[0] == bpe.bos_token_id and ids[1] != bpe.bos_token_id and ids.count(bpe.bos_token_id) == 1
    assert bpe.decode(ids) == shown.rendered
    # the tokenizer's own special tokens would have doubled it
    assert bpe(shown.rendered)["input_ids"][:2] == [bpe.bos_token_id] * 2
    # a prompt's own conversation; its own system message wins over the flag's
    chat = Prompt(id="c", text="hi", answer="1", messages=(("system", "Own."), ("user", "1+0?")))
    assert fmt.apply(chat).rendered == "<bos><|system|>Own.<|end|><|user|>1+0?<|end|><|assistant|>"
    assert PromptFormat(bpe).apply(chat).rendered.count("<|system|>") == 1


def test_a_template_file_and_its_refusals(bpe, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}[assistant] {% endif %}")
    shown = PromptFormat(bpe, str(path), SYSTEM).apply(Prompt(id="p", text="1+1=", answer="2"))
    assert shown.rendered == f"[system] {SYSTEM}\n[user] 1+1=\n[assistant] "
    ids = prompt_ids(bpe, [shown])[0]
    assert bpe.bos_token_id not in ids  # a template without BOS gets none added
    with pytest.raises(ValueError, match=r"chat_template = '.*missing.jinja' is not a file \(allowed: auto, none"):
        PromptFormat(bpe, str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="system_prompt = 'x' has no effect with chat_template = 'none'"):
        PromptFormat(bpe, "none", "x")


def test_a_template_that_fails_on_a_later_prompt_is_a_config_error(bpe, tmp_path):
    """The builder renders only the first prompt; one the template refuses later (a held-out one, or mid-run) is a
    one-line ConfigError naming the setting and the prompt, not a ValueError that ended in a traceback."""
    path = tmp_path / "seven.jinja"
    path.write_text('{% for m in messages %}{% if "7" in m.content %}{{ raise_exception("no sevens") }}{% endif %}'
                    "{{ m.content }}{% endfor %}")
    fmt = PromptFormat(bpe, str(path))
    assert fmt.apply(Prompt(id="a", text="1+2=", answer="3")).rendered == "1+2="
    with pytest.raises(ConfigError, match=r"chat_template = '.*seven.jinja' cannot render prompt 'b' "
                                          r"\(TemplateError: no sevens\)"):
        fmt.apply(Prompt(id="b", text="97+60=", answer="157"))
    with pytest.raises(ConfigError, match="prompt 'c' is given as chat messages"):
        PromptFormat(bpe, "none").apply(Prompt(id="c", text="x", answer="1", messages=(("user", "x"),)))


def test_plain_mode_is_unchanged(bpe, char_model):
    """No template (none, or auto with a character tokenizer): the task itself, ids as the tokenizer gives them."""
    from polyrl.model import load_policy

    _, char = load_policy(char_model, threads=1)
    task = AdditionTask()
    for tokenizer, setting in ((bpe, "none"), (char, "auto")):
        fmt = PromptFormat(tokenizer, setting)
        assert not fmt.templated and formatted_task(task, fmt) is task
        prompts = task.prompts("train", 5, 0)
        assert [fmt.apply(p) for p in prompts] == prompts
        assert prompt_ids(tokenizer, prompts) == tokenizer([p.text for p in prompts])["input_ids"]
        assert prompt_ids(tokenizer, ["12+"]) == [tokenizer("12+", add_special_tokens=True)["input_ids"]]
    with pytest.raises(ValueError, match="given as chat messages, which need a chat template"):
        PromptFormat(bpe, "none").apply(Prompt(id="m", text="q", answer="1", messages=(("user", "q"),)))


def test_the_math_task_takes_messages_and_prompt_columns(tmp_path):
    rows = [{"messages": [{"role": "system", "content": "Be exact."}, {"role": "user", "content": r["question"]}],
             "answer": r["answer"], "source": "x"} for r in _rows()]
    task = MathTask(_write(tmp_path / "m.jsonl", rows))
    assert task.message_rows == 40
    chats = [p for split in ("train", "test") for p in task._pools[split]]
    assert len(chats) == 40 and len({p.id for p in chats}) == 40
    assert all(p.messages[0] == ("system", "Be exact.") and len(p.messages) == 2 for p in chats)
    assert all(p.text == p.messages[-1][1] for p in chats)  # the question, for reward functions
    # the ids are stable: the same file gives the same ids
    assert [p.id for p in MathTask(str(tmp_path / "m.jsonl")).prompts("train", 10, 1)] == \
        [p.id for p in task.prompts("train", 10, 1)]
    # TRL's conversational prompt column
    conv = [{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]} for r in _rows()]
    task = MathTask(_write(tmp_path / "p.jsonl", conv))
    assert task.message_rows == 40 and task.prompts("train", 1, 0)[0].messages[0][0] == "user"
    # Parquet: a list of structs
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(conv), tmp_path / "p.parquet")
    assert [p.id for p in MathTask(str(tmp_path / "p.parquet")).prompts("train", 5, 0)] == \
        [p.id for p in task.prompts("train", 5, 0)]


@pytest.mark.parametrize("messages,problem", [
    ([], "are an empty list"),
    (["hi"], "are not all objects (message 1 is a string)"),
    ([{"content": "hi"}], "lack a role (message 1 has role None"),
    ([{"role": "user", "content": ["a", "b"]}], "lack text content (message 1 has content list"),
    ([{"role": "system", "content": "s"}], "have no user message"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "end with an assistant message"),
])
def test_bad_messages_rows_are_refused_in_one_line(tmp_path, messages, problem):
    rows = [{"messages": [{"role": "user", "content": r["question"]}], "answer": r["answer"]} for r in _rows()]
    rows[6]["messages"] = messages
    path = _write(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataFileError) as e:
        MathTask(path)
    message = str(e.value)
    assert message.startswith(f"data_file {path!r} row 7 (line 7) has chat messages in 'messages' that {problem}")
    assert "\n" not in message


def test_the_builder_refuses_what_a_template_cannot_do(tmp_path, qwen, char_model):
    chat = _write(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": r["question"]}],
                                             "answer": r["answer"]} for r in _rows()])
    cases = [
        (["--model", qwen, "--task", "math", "--data-file", chat, "--chat-template", "none"],
         "gives 40 prompt(s) as chat messages, which need a chat template, but chat_template = 'none'"),
        (["--model", char_model, "--system-prompt", "Be brief."],
         "system_prompt = 'Be brief.' has no effect with chat_template = 'auto' (model"),
        (["--model", qwen, "--system-prompt", "Be brief.", "--chat-template", "none"],
         "system_prompt = 'Be brief.' has no effect with chat_template = 'none'"),
        (["--model", qwen, "--chat-template", str(tmp_path / "nope.jinja")], "nope.jinja' is not a file"),
        # a "template" that renders no message (or a file that is no template: config.json) ran on every prompt
        (["--model", qwen, "--chat-template", str(tmp_path / "fixed.jinja")],
         "leaves the user message out of what it renders (prompt 'addition/"),
        (["--model", qwen, "--chat-template", str(tmp_path / "nosys.jinja"), "--system-prompt", "Be terse."],
         "leaves the system message out of what it renders"),
    ]
    (tmp_path / "fixed.jinja").write_text("You are a helpful assistant.")
    (tmp_path / "nosys.jinja").write_text("{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}"
                                          "{% endif %}{% endfor %}")
    for argv, expected in cases:
        with pytest.raises(ConfigError) as e:
            _resolve(argv, tmp_path)
        assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert "--chat-template" in str(pytest.raises(ConfigError, _resolve, cases[0][0], tmp_path).value)
    # accepted where they act
    plan = _resolve(["--model", qwen, "--task", "math", "--data-file", chat, "--system-prompt", "Be brief."], tmp_path)
    assert plan.cfg.data.system_prompt == "Be brief."


def test_an_end_of_turn_eos_stops_and_is_not_in_the_text(qwen, bpe):
    """The model's end of turn (<|end|>, an EOS of its generation config) ends the completion; decoding drops it."""
    from polyrl.model import load_policy

    model, tok = load_policy(qwen, threads=1)
    end, word = tok.convert_tokens_to_ids(END_OF_TURN), tok("4", add_special_tokens=False)["input_ids"][0]
    with torch.no_grad():  # a head that writes "4" after the generation prompt's marker, then ends the turn
        model.lm_head.weight.zero_()
        model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.lm_head.out_features))
        model.lm_head.bias[end] = 50.0
    task = formatted_task(AdditionTask(), PromptFormat(tok, "auto", SYSTEM))
    assert isinstance(task, FormattedTask)
    runner = EpisodeRunner(HFGenerator(model, tok), tok, task)
    prompts = task.prompts("train", 2, 0)
    samples = runner.sample(prompts, SamplingParams(n=2, max_new_tokens=6, seed=0))
    for s in samples:
        assert s.completion_token_ids == [end] and s.finish_reason == "stop" and s.text == ""
        assert s.prompt_token_ids == prompt_ids(tok, [prompts[s.prompt_index]])[0]
        assert s.prompt_token_ids.count(tok.bos_token_id) == 1
    decoded = tok.batch_decode([[word, end], [word, tok.eos_token_id]], skip_special_tokens=True)
    assert decoded == ["4", "4"]


def test_math_with_a_chat_template_trains_end_to_end(tmp_path, qwen):
    from polyrl.cli import main

    data, run = _write(tmp_path / "f.jsonl", _rows()), tmp_path / "run"
    code = main(["train", "--task", "math", "--data-file", data, "--model", qwen, "--chat-template", "auto",
                 "--system-prompt", SYSTEM, "--steps", "2", "--prompts-per-step", "2", "--group-size", "2",
                 "--max-new-tokens", "8", "--eval-prompts", "4", "--run-dir", str(run), "--threads", "1",
                 "--checkpoint-every", "0", "--log-every", "1", "--no-tensorboard"])
    assert code == 0
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples
    for row in samples:
        assert row["prompt"].startswith(f"<bos><|system|>{SYSTEM}<|end|><|user|>"), row
        assert row["prompt"].endswith("<|assistant|>") and "<|end|>" not in row["completion"], row
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in steps if "objective/loss" in r}) == [1, 2]


@pytest.mark.parametrize("setting", ["file", "none", "auto"])
def test_an_export_renders_prompts_as_its_run_did(tmp_path, qwen, setting):
    """The exported tokenizer carries the run's template: the file's text as the run read it (not the base's own; the
    file moved away since), none for plain-text prompts, the base's own for auto. Every prompt the run logged is
    one of the data file's questions as the export renders it."""
    from transformers import AutoTokenizer

    from polyrl.cli import main

    template = tmp_path / "t.jinja"
    text = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    template.write_text(text)
    chosen = {"file": str(template), "none": "none", "auto": "auto"}[setting]
    data, run = _write(tmp_path / "f.jsonl", _rows()), tmp_path / "run"
    assert main(["train", "--task", "math", "--data-file", data, "--model", qwen, "--chat-template", chosen,
                 "--steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4",
                 "--eval-prompts", "2", "--run-dir", str(run), "--threads", "1", "--log-every", "1",
                 "--no-tensorboard"]) == 0
    template.rename(tmp_path / "moved.jinja")
    assert main(["export", str(run), str(tmp_path / "out")]) == 0
    exported = AutoTokenizer.from_pretrained(tmp_path / "out")
    own = AutoTokenizer.from_pretrained(qwen).chat_template
    assert exported.chat_template == {"file": text, "none": None, "auto": own}[setting]
    task = MathTask(data)
    questions = [p.text for split in ("train", "test") for p in task.prompts(split, 40, 0)]  # the task's wording
    rendered = {q if setting == "none" else exported.apply_chat_template(
        [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True) for q in questions}
    trained = {json.loads(line)["prompt"] for line in (run / "samples.jsonl").read_text().splitlines()}
    assert trained and trained <= rendered, (sorted(trained)[:1], sorted(rendered)[:1])
    assert json.loads((tmp_path / "out" / "polyrl_export.json").read_text())["chat_template"] == chosen
