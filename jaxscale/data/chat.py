"""Chat and instruction data: records rendered by a chat template into tokens and a loss mask.

A record is a conversation, {"messages": [{"role": ..., "content": ...}, ...]}, or a prompt and
its completion, {"prompt": ..., "completion": ...}: two strings, joined as they are (the completion
ends with the tokenizer's EOS, trained, so the model learns to stop), or two lists of messages,
rendered as one conversation. `data.train_on` picks the trained tokens: `all`, `assistant` (every
assistant turn; the completion) or `completion` (the last assistant turn; the completion).

The template (`data.chat_template`) is the tokenizer's own (chat_template.jinja, or the
chat_template of tokenizer_config.json, beside data.tokenizer's tokenizer.json), a Jinja file, or
`chatml`; it is rendered by Jinja2 in a sandbox, as transformers' apply_chat_template renders it.
Where each answer starts and ends comes from rendering prefixes of the conversation: through the
turn before it with the generation prompt, then through the answer. A template whose renderings
are not prefixes of the whole conversation is refused, naming data.chat_template. Each span is
tokenized on its own, so no token straddles a prompt and its answer.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import numpy as np

from jaxscale.data import formats
from jaxscale.data.encode import token_dtype
from jaxscale.data.tokenize import Tokenizer
from jaxscale.errors import ConfigError

FIELD = "data.chat_template"
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
Spans = list[tuple[str, bool]]  # (text, trained) in order


class Template:
    """A chat template, compiled once; render(messages, add_generation_prompt) -> text."""

    def __init__(self, source: str, special: dict[str, str], name: str):
        try:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise ConfigError(FIELD, name, "chat templates need Jinja2: pip install jinja2") from None
        self.name, self.special, self._error = name, special, TemplateError
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols", _generation_tag()])
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        env.globals.update(raise_exception=_raise, strftime_now=lambda f: datetime.datetime.now().strftime(f))
        try:
            self._template = env.from_string(source)
        except TemplateError as error:
            raise ConfigError(FIELD, name, f"is not a Jinja template ({error})") from None

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special)
        except self._error as error:
            raise ConfigError(FIELD, self.name, f"failed on a record ({error})") from None


def _generation_tag():
    """transformers' {% generation %} ... {% endgeneration %} (its marker of the assistant's
    tokens), rendered as its body: the spans here come from rendering prefixes instead."""
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return Generation


def _raise(message: str):
    from jinja2 import TemplateError

    raise TemplateError(message)


def _special(config: dict) -> dict[str, str]:
    """bos_token, eos_token, ... of a tokenizer_config.json, as strings (they may be dicts)."""
    tokens = {key: value for key, value in config.items() if key.endswith("_token")}
    return {key: value.get("content", "") if isinstance(value, dict) else value for key, value in tokens.items()
            if isinstance(value, str | dict)}


def _from_config(path: Path, name: str) -> tuple[str, dict[str, str]]:
    config = json.loads(path.read_text())
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    beside = path.parent / "chat_template.jinja"
    if beside.is_file():
        source = beside.read_text()
    if not isinstance(source, str):
        raise ConfigError(FIELD, name, f"{path} has no chat_template; name a .jinja file or chatml")
    return source, _special(config)


def load_template(spec: str, tokenizer: str) -> Template:
    """data.chat_template: '' (the tokenizer's own), 'chatml', a .jinja file, or a tokenizer
    directory or tokenizer_config.json; ConfigError(data.chat_template) when there is none."""
    if spec == "chatml":
        return Template(CHATML, {}, spec)
    path = Path(spec) if spec else Path(tokenizer).parent
    if path.is_dir():
        path = path / "tokenizer_config.json"
    if not path.is_file():
        where = f"{spec}: no such file" if spec else \
            f"data.tokenizer={tokenizer} has no tokenizer_config.json beside it"
        raise ConfigError(FIELD, spec, f"{where}; name a .jinja file, a tokenizer directory, or chatml")
    if path.suffix == ".json":
        return Template(*_from_config(path, spec or str(path)), spec or str(path))
    config = path.parent / "tokenizer_config.json"
    special = _special(json.loads(config.read_text())) if config.is_file() else {}
    return Template(path.read_text(), special, spec)


# --- records ---------------------------------------------------------------------------------

def is_chat(path: Path, text_field: str) -> bool:
    """Whether `path` holds chat records: a record format whose first record has no text field
    but messages, or a prompt and a completion."""
    if formats.kind_of(path) not in formats.RECORD_KINDS:
        return False
    first = next(formats.records(path), None)
    return first is not None and text_field not in first[0] and ("messages" in first[0] or
                                                                 {"prompt", "completion"} <= set(first[0]))


def needs_template(path: Path, spec: str) -> bool:
    """Whether records of `path` need a chat template: one is named (`spec`), or its first record
    is a conversation (prompt and completion strings are joined without one)."""
    first = next(formats.records(path))[0]
    return bool(spec) or not (isinstance(first.get("prompt"), str) and "messages" not in first)


# --- spans -----------------------------------------------------------------------------------

def _messages(value, where: str, key: str) -> list[dict]:
    ok = isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
                                         for m in value)
    if not ok:
        raise ConfigError(formats.PATH, where, f"its {key} must be a list of {{role, content}} objects")
    return value


def _turns(template: Template, messages: list[dict], answers: list[int], where: str) -> Spans:
    """The conversation rendered, cut where each answer (by index) starts and ends."""
    whole = template.render(messages, add_generation_prompt=False)
    cuts = []
    for i in answers:
        cuts += [template.render(messages[:i], add_generation_prompt=True),
                 template.render(messages[:i + 1], add_generation_prompt=False)]
    if any(not whole.startswith(cut) for cut in cuts) or [len(c) for c in cuts] != sorted(len(c) for c in cuts):
        raise ConfigError(FIELD, template.name, f"renders {where} so that a turn's prefix is not a prefix of the "
                          "whole conversation; use a template that only appends (e.g. chatml)")
    ends = [0, *(len(c) for c in cuts), len(whole)]
    return [(whole[a:b], k % 2 == 1) for k, (a, b) in enumerate(zip(ends, ends[1:])) if b > a]


def spans(record: dict, template: Template | None, train_on: str, where: str) -> tuple[Spans, bool]:
    """(the record's text in (text, trained) spans, whether the EOS after it is trained)."""
    if "messages" in record:
        messages = _messages(record["messages"], where, "messages")
        prompt = []
    elif {"prompt", "completion"} <= set(record):
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return [(prompt, train_on == "all"), (completion, True)], True
        prompt = _messages(prompt, where, "prompt")
        messages = prompt + _messages(completion, where, "completion")
    else:
        raise ConfigError(formats.PATH, where, f"has keys {sorted(record)}; give messages, or prompt and completion")
    if template is None:
        raise ConfigError(FIELD, "", "conversations need a chat template; set data.chat_template")
    if train_on == "all":
        return [(template.render(messages, add_generation_prompt=False), True)], True
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= len(prompt)]
    return _turns(template, messages, answers[-1:] if train_on == "completion" else answers, where), False


def encode(path: Path, template: Template | None, tokenizer: Tokenizer,
           train_on: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, mask) of every record of `path`, each followed by the tokenizer's EOS: int arrays
    of one length, mask 1 where a token is trained."""
    return encode_records(formats.records(path), template, tokenizer, train_on)[:2]


def encode_records(records, template: Template | None, tokenizer: Tokenizer,
                   train_on: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, mask, ends) of (record, where) pairs: as `encode`, with the offset just after each
    record's EOS (a token store's document index)."""
    tokens, mask, ends = [], [], []
    for record, where in records:
        ids, trained = tokenized(*spans(record, template, train_on, where), tokenizer)
        tokens += ids
        mask += trained
        ends.append(len(tokens))
    return (np.asarray(tokens, token_dtype(tokenizer.vocab_size)), np.asarray(mask, np.uint8),
            np.asarray(ends, np.uint64))


def tokenized(cut: Spans, eos_trained: bool, tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """(tokens, mask) of a record's spans (see spans), each span tokenized on its own, and the EOS after them."""
    tokens, mask = [], []
    for text, trained in cut:
        ids = tokenizer.encode(text)
        tokens += ids
        mask += [int(trained)] * len(ids)
    return tokens + [tokenizer.eos_id], mask + [int(eos_trained)]
