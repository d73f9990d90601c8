"""Prompts as chat: the one place a task's prompt becomes the text and the token ids the model is conditioned on.

``--chat-template`` (``DataConfig.chat_template``): ``auto`` renders every prompt with the tokenizer's own chat
template when it has one and keeps plain text otherwise (the character tokenizers of the warm starts have none);
``none`` keeps plain text; any other value is the path of a Jinja template file. With a template, the system
message of ``--system-prompt`` (when given, and when the prompt has no system message of its own) and the prompt's
messages (``Prompt.messages``, else one user message holding ``Prompt.text``) are rendered with the generation
prompt (``apply_chat_template(..., add_generation_prompt=True)``) into ``Prompt.rendered``.

A rendered template already holds its special tokens (BOS, role markers), so ``prompt_ids`` encodes it without the
tokenizer's own and no BOS is doubled; plain text is encoded with them, exactly as before chat templates existed.
Every place that turns prompts into ids (episodes, generators, the tree sampler's features and answer
likelihood) calls ``prompt_ids``.

``formatted_task`` wraps a task so that its prompts come rendered: the training stream, the evaluator,
``samples.jsonl`` and the tree sampler all see the text the model sees (``Prompt.model_text``), while the task's
reward and custom reward functions still receive the task's own text (``Prompt.text``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polyrl.errors import ConfigError
from polyrl.tasks.base import Prompt, Split

PLAIN, AUTO = "none", "auto"


def read_template(chat_template: str) -> str | None:
    """The Jinja text of a ``chat_template`` setting that names a file (None for auto and none); a missing,
    unreadable or empty file is a one-line ValueError naming the setting and the path."""
    if chat_template in (AUTO, PLAIN):
        return None
    path = Path(chat_template)
    allowed = "auto, none or the path of a Jinja chat template file"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"chat_template = {chat_template!r} is not a file (allowed: {allowed})") from None
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) else f"not UTF-8 text: {e.reason}"
        raise ValueError(f"chat_template = {chat_template!r} cannot be read ({reason}; allowed: {allowed})") from None
    if not text.strip():
        raise ValueError(f"chat_template = {chat_template!r} is an empty file (allowed: {allowed})")
    return text


def resolve_template(chat_template: str, tokenizer_template: Any, system_prompt: str | None = None,
                     *, model: str = "the model") -> str | None:
    """The template a run renders its prompts with (None: plain text), checked: a system prompt needs one."""
    template = read_template(chat_template)
    if chat_template == AUTO:
        template = tokenizer_template or None
    if template is None and system_prompt is not None:
        why = ("plain-text prompts" if chat_template == PLAIN else
               f"{model} has a tokenizer without a chat template, so prompts stay plain text")
        raise ValueError(f"system_prompt = {system_prompt!r} has no effect with chat_template = {chat_template!r} "
                         f"({why}): give --chat-template auto with a tokenizer that has a template, or a Jinja "
                         "file, or drop --system-prompt")
    return template


class PromptFormat:
    """How a run's prompts are put to the model: plain text, or chat messages rendered by a template."""

    def __init__(self, tokenizer, chat_template: str = AUTO, system_prompt: str | None = None,
                 *, model: str = "the model") -> None:
        self.tokenizer = tokenizer
        self.setting = chat_template
        self.template = resolve_template(chat_template, getattr(tokenizer, "chat_template", None), system_prompt,
                                         model=model)
        self.system_prompt = system_prompt
        self._rendered: dict[Prompt, Prompt] = {}  # a pool repeats its prompts: render each once

    @property
    def templated(self) -> bool:
        return self.template is not None

    def messages(self, prompt: Prompt) -> list[dict[str, str]]:
        """The chat messages of ``prompt``: the system prompt (unless it has its own), then its turns."""
        turns = list(prompt.messages) if prompt.messages is not None else [("user", prompt.text)]
        if self.system_prompt is not None and turns[0][0] != "system":
            turns.insert(0, ("system", self.system_prompt))
        return [{"role": role, "content": content} for role, content in turns]

    def apply(self, prompt: Prompt) -> Prompt:
        """``prompt`` as the model sees it: ``rendered`` set by the template, or itself in plain mode. A prompt the
        format cannot put (messages without a template, a template that fails on it) is a ``ConfigError`` naming the
        setting and the prompt: the builder renders only the first, and a later one, held-out prompts included, must
        be one line too, not a traceback."""
        if self.template is None:
            if prompt.messages is not None:
                raise ConfigError(f"prompt {prompt.id!r} is given as chat messages, which need a chat template, "
                                 f"but chat_template = {self.setting!r} leaves prompts plain text: use "
                                 "--chat-template auto with a tokenizer that has one, or --chat-template PATH")
            return prompt
        done = self._rendered.get(prompt)
        if done is None:
            own = None if self.setting == AUTO else self.template  # auto: the tokenizer's (named templates too)
            try:
                text = self.tokenizer.apply_chat_template(self.messages(prompt), chat_template=own,
                                                          add_generation_prompt=True, tokenize=False)
            except Exception as e:  # Jinja errors, a template's raise_exception (e.g. no system role)
                reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise ConfigError(f"chat_template = {self.setting!r} cannot render prompt {prompt.id!r} "
                                 f"({type(e).__name__}: {reason})") from None
            done = self._rendered[prompt] = dataclasses.replace(prompt, rendered=text)
        return done


def own_unk_id(tokenizer) -> int | None:
    """The id a tokenizer writes for text it has no token for, when that id means nothing else: GPT-2-style
    tokenizers name ``<|endoftext|>`` (their BOS and EOS) as unk, but, byte-level, never need it."""
    unk = getattr(tokenizer, "unk_token_id", None)
    others = {getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad")}
    return None if unk is None or unk in others else unk


def unknown_characters(tokenizer, unk: int, text: str) -> list[str]:
    """The characters of ``text`` that ``tokenizer`` writes as its unk id ``unk`` (``own_unk_id``), sorted."""
    return sorted({c for c in text if unk in tokenizer(c, add_special_tokens=False)["input_ids"]})


def prompt_ids(tokenizer, prompts: Sequence[Prompt | str], suffixes: Sequence[str] | None = None) -> list[list[int]]:
    """The token ids each prompt conditions the model on (with ``suffixes[i]`` appended to its text).

    A rendered chat template holds its own special tokens and is encoded without the tokenizer's (no second BOS);
    plain text (a Prompt that was not rendered, or a str) is encoded with them, as a plain-text model expects.
    """
    texts = [p if isinstance(p, str) else p.model_text for p in prompts]
    if suffixes is not None:
        texts = [t + s for t, s in zip(texts, suffixes, strict=True)]
    special = [isinstance(p, str) or p.rendered is None for p in prompts]
    out: list[list[int]] = [[] for _ in texts]
    for flag in (True, False):
        where = [i for i, s in enumerate(special) if s is flag]
        if where:
            for i, ids in zip(where, tokenizer([texts[i] for i in where], add_special_tokens=flag)["input_ids"]):
                out[i] = list(ids)
    return out


class FormattedTask:
    """A task whose prompts come through a ``PromptFormat``; its reward and everything else are the task's."""

    def __init__(self, task, prompt_format: PromptFormat) -> None:
        self.task, self.format, self.name = task, prompt_format, task.name

    def prompts(self, split: Split, n: int, seed: int) -> list[Prompt]:
        return [self.format.apply(p) for p in self.task.prompts(split, n, seed)]

    def reward(self, prompt: Prompt, completion_text: str) -> tuple[float, dict[str, Any]]:
        return self.task.reward(prompt, completion_text)

    def __getattr__(self, name: str):  # exact_answer, data files, ... (not while unpickling: no task yet)
        if name.startswith("__") or "task" not in vars(self):
            raise AttributeError(name)
        return getattr(self.task, name)


class FormattedToolTask(FormattedTask):
    """The same for a multi-turn task (``rollout.episodes.ToolTask``), whose members are declared for the protocol."""

    @property
    def tool_stop(self) -> str:
        return self.task.tool_stop

    @property
    def max_turns(self) -> int:
        return self.task.max_turns

    def respond(self, prompt: Prompt, transcript: str) -> str | None:
        return self.task.respond(prompt, transcript)


def formatted_task(task, prompt_format: PromptFormat):
    """``task`` with its prompts put to the model by ``prompt_format``; the task itself in plain mode."""
    if not prompt_format.templated:
        if getattr(task, "message_rows", 0):
            raise ValueError(_needs_template(task, prompt_format.setting))
        return task
    multi_turn = callable(getattr(task, "respond", None))  # rollout.episodes.ToolTask (not imported: no circle)
    return (FormattedToolTask if multi_turn else FormattedTask)(task, prompt_format)


def _needs_template(task, setting: str) -> str:
    where = getattr(task, "_label", f"task {task.name!r}")
    return (f"{where} gives {task.message_rows} prompt(s) as chat messages, which need a chat template, but "
            f"chat_template = {setting!r} leaves prompts plain text: use --chat-template auto with a model whose "
            "tokenizer has one, or --chat-template PATH")


def check_prompt_format(chat_template: str, system_prompt: str | None, model_dir: str | None, task) -> None:
    """The builder's checks of the prompt format, before anything heavy is loaded (ValueError, one line): a template
    file that cannot be read, a system prompt without a template, message prompts without one, a template that
    cannot render the task's first prompt. No model (a warm start's character tokenizer) has no template."""
    tokenizer = None
    if model_dir is not None and chat_template != PLAIN:
        from polyrl.model import load_tokenizer

        tokenizer = load_tokenizer(model_dir)  # a damaged tokenizer is a one-line ConfigError naming the model
    model = f"model {model_dir!r}" if model_dir is not None else "the warm start"
    if tokenizer is None:
        template = resolve_template(chat_template, None, system_prompt, model=model)
        if template is not None:
            raise ValueError(f"chat_template = {chat_template!r} needs --model (a warm start's character tokenizer "
                             "knows no chat markup)")
        if getattr(task, "message_rows", 0):
            raise ValueError(_needs_template(task, chat_template))
        return
    fmt = PromptFormat(tokenizer, chat_template, system_prompt, model=model)
    formatted_task(task, fmt)  # message prompts without a template
    if fmt.templated:
        first = task.prompts("train", 1, 0)[0]
        rendered = fmt.apply(first).rendered or ""
        messages = fmt.messages(first)
        for role in ("user", "system"):  # a template that drops them (or a file that is no template) runs on
            said = [" ".join(m["content"].split()) for m in messages if m["role"] == role][-1:]
            if said and said[0] and said[0] not in " ".join(rendered.split()):
                raise ValueError(f"chat_template = {chat_template!r} leaves the {role} message out of what it "
                                 f"renders (prompt {first.id!r} became {rendered[:60]!r}); a template must render "
                                 "every message")
