"""Chat templates: a prompt in the text an instruct model was tuned on, rendered as transformers renders it.

An instruct checkpoint carries its chat template, a jinja2 string, in
``tokenizer_config.json`` (key ``chat_template``: one template, or a list of
named ones of which ``default`` is used) or, as transformers 5 saves it, in
``chat_template.jinja``, which then takes priority. A prompt becomes the
messages [system (optional), user], rendered with the generation prompt
appended; the text must equal transformers'
``apply_chat_template(messages, tokenize=False, add_generation_prompt=True)``
character for character, so the jinja2 environment here is transformers' own:
sandboxed, ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension and the ``{% generation %}`` tag, the globals ``raise_exception``
and ``strftime_now``, a ``tojson`` that does not escape HTML, and the
tokenizer's named special tokens (``bos_token``, ``eos_token``, ...) as
variables. A template runs in jinja2's sandbox: it is data, never code.

The rendered text holds the special tokens itself (``bos_token``, the role
headers), so it is encoded with no special tokens added, as transformers
encodes it.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pivotrl.errors import UserError

TEMPLATE_FILE = "chat_template.jinja"  # transformers 5 writes a single template here, beside tokenizer_config.json
CONFIG_FILE = "tokenizer_config.json"
# the tokenizer attributes transformers passes to a template (``special_tokens_map``)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(slots=True, frozen=True)
class ChatTemplate:
    """A checkpoint's chat template and what it is rendered with (plain values: it travels to Ray actors).

    Calling it renders a prompt: ``chat(prompt)`` is ``chat.render(prompt)``.
    """

    source: str  # the jinja2 template
    # (name, text) of bos_token, eos_token, ...: the variables the template sees beside the messages
    special_tokens: tuple[tuple[str, str], ...] = ()
    system: str | None = None  # the system message before every prompt; None: none (the template's default, if any)

    def render(self, prompt: str) -> str:
        """The chat text of one user message holding ``prompt``, the assistant's turn opened after it."""
        messages = [{"role": "user", "content": prompt}]
        if self.system is not None:
            messages.insert(0, {"role": "system", "content": self.system})
        return _compile(self.source).render(
            messages=messages, tools=None, documents=None, add_generation_prompt=True, **dict(self.special_tokens)
        )

    __call__ = render


def load_chat_template(path: str | Path, key: str, system: str | None = None) -> ChatTemplate:
    """The chat template of checkpoint directory ``path``, checked by rendering a prompt once.

    ``key`` is the config key that asked for it (``task.chat_template``): every
    error names it and the directory, so a missing or broken template stops the
    job before any device starts.
    """
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{key}: checkpoint directory {str(path)!r} does not exist")
    try:
        config = _read_config(path)
    except ValueError as e:
        raise UserError(f"{key}: {e}") from None
    template_file = path / TEMPLATE_FILE
    if template_file.is_file():
        source: Any = template_file.read_text(encoding="utf-8")
    else:
        source = _default_template(config.get("chat_template"), path, key)
    if not isinstance(source, str) or not source.strip():
        raise UserError(
            f"{key}: {path} has no chat template (no chat_template in {CONFIG_FILE}, no {TEMPLATE_FILE}); "
            f"set {key}.enabled=false or use a checkpoint that has one"
        )
    chat = ChatTemplate(source, tuple(special_tokens(config).items()), system)
    try:
        chat.render("1+1=")
    except Exception as e:  # whatever a broken template raises: syntax, raise_exception, a bad operation
        what = "with a system message" if system is not None else "a prompt"
        raise UserError(f"{key}: the chat template of {path} fails to render {what}: {e}") from None
    return chat


def special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """The special tokens a template sees, from a ``tokenizer_config.json``: the named ones that are set,
    and the model's own named tokens (``extra_special_tokens`` given as a mapping)."""
    named = {k: config.get(k) for k in SPECIAL_TOKENS}
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        named |= extra
    out = {}
    for name, value in named.items():
        if isinstance(value, dict):  # an AddedToken written as a dict
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def copy_chat_template(src: str | Path, dst: str | Path) -> bool:
    """Carry the chat template of checkpoint ``src`` over to checkpoint ``dst`` (a trained copy of it, whose
    ``tokenizer_config.json`` was written without one); returns whether there was one to carry."""
    src, dst = Path(src), Path(dst)
    if (src / TEMPLATE_FILE).is_file():
        (dst / TEMPLATE_FILE).write_text((src / TEMPLATE_FILE).read_text(encoding="utf-8"), encoding="utf-8")
        return True
    template = _read_config(src).get("chat_template")
    if template is None:
        return False
    config = _read_config(dst)
    config["chat_template"] = template
    (dst / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return True


def _read_config(path: Path) -> dict[str, Any]:
    """The checkpoint's ``tokenizer_config.json`` ({} when it has none)."""
    file = path / CONFIG_FILE
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{file} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} holds {type(config).__name__}, expected a JSON object")
    return config


def _default_template(entry: Any, path: Path, key: str) -> Any:
    """The template transformers uses when given no name: the only one, or the one named ``default``."""
    if isinstance(entry, list):  # [{"name": ..., "template": ...}, ...]
        entry = {t.get("name"): t.get("template") for t in entry if isinstance(t, dict)}
    if isinstance(entry, dict):
        if "default" not in entry:
            names = ", ".join(sorted(map(str, entry)))
            raise UserError(f"{key}: {path} has named chat templates ({names}) but none named 'default'")
        return entry["default"]
    return entry


# -- transformers' jinja2 environment ---------------------------------------------------------------


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks the assistant's tokens for training masks in
    transformers; rendering a prompt it writes its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
