"""Chat templates: what pivotrl renders equals transformers' ``apply_chat_template`` on the same checkpoint files.

The templates are written here in the style of real instruct checkpoints (none is downloaded): ChatML as
Qwen2.5 writes it (a default system message, a tools branch), Llama 3.1's (``bos_token``, header tokens,
``strftime_now``, the system message taken out of the list), Gemma's (``raise_exception`` on a system
message), and one that uses every feature of transformers' jinja2 environment.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pivotrl.errors import UserError
from pivotrl.model import char_tokenizer
from pivotrl.model.chat import ChatTemplate, copy_chat_template, load_chat_template

CHATML = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}

{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)

# every feature of the environment: loop controls, the generation tag, namespace, tojson (no HTML escaping)
FEATURES = """{{ bos_token }}{% set ns = namespace(turns=0) %}
{% for message in messages %}
  {% if message.role == 'system' %}{{ '[SYS]' + message.content + '[/SYS]' }}{% continue %}{% endif %}
  {% set ns.turns = ns.turns + 1 %}
  {% generation %}{{ message.role | upper }}: {{ message.content }}{{ eos_token }}{% endgeneration %}
  {% if ns.turns > 3 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}{{ {'turns': ns.turns, 'quote': '<a & "b">', 'name': 'Zoë'} | tojson }}
ASSISTANT:{% endif %}"""

TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "gemma": GEMMA, "features": FEATURES}
PROMPTS = ["07+38=", "  What is {x} + 1?\n\n", "Ünïcødé ✓ <|im_end|> {{ not jinja }}"]
SYSTEMS = [None, "You are a careful grader.\n", ""]


def checkpoint(path: Path, template: str | list | None, jinja_file: str | None = None, **config) -> Path:
    """A tokenizer directory as a checkpoint has one: tokenizer.json, tokenizer_config.json (with its
    chat template) and, optionally, chat_template.jinja."""
    char_tokenizer().save(path)
    file = path / "tokenizer_config.json"
    meta = json.loads(file.read_text()) | config
    if template is not None:
        meta["chat_template"] = template
    file.write_text(json.dumps(meta, indent=2))
    if jinja_file is not None:
        (path / "chat_template.jinja").write_text(jinja_file)
    return path


def messages(prompt: str, system: str | None) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": prompt}
    ]


def transformers_text(path: Path, prompt: str, system: str | None = None) -> str:
    tok = AutoTokenizer.from_pretrained(path)
    return tok.apply_chat_template(messages(prompt, system), tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("system", SYSTEMS, ids=["no-system", "system", "empty-system"])
@pytest.mark.parametrize("name", [n for n in TEMPLATES if n != "gemma"])
def test_renders_as_transformers_does(name, system, tmp_path):
    path = checkpoint(tmp_path, TEMPLATES[name])
    chat = load_chat_template(path, "task.chat_template", system)
    for prompt in PROMPTS:
        assert chat.render(prompt) == transformers_text(path, prompt, system)
        assert chat(prompt) == chat.render(prompt)


def test_gemma_without_a_system_message_renders_as_transformers_does(tmp_path):
    path = checkpoint(tmp_path, GEMMA)
    chat = load_chat_template(path, "judge.chat_template")
    for prompt in PROMPTS:
        assert chat(prompt) == transformers_text(path, prompt)


def test_the_defaults_of_the_templates(tmp_path):
    """What the renders look like: the default system message of ChatML, Llama's BOS and headers."""
    chatml = load_chat_template(checkpoint(tmp_path / "chatml", CHATML), "k")
    assert chatml("2+2=") == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"
    )
    llama = load_chat_template(checkpoint(tmp_path / "llama", LLAMA3), "k", "Be brief. ")
    text = llama(" 2+2= ")
    assert text.startswith("<bos><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date")
    assert text.endswith("Be brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n2+2=<|eot_id|>"
                         "<|start_header_id|>assistant<|end_header_id|>\n\n")  # fmt: skip


@pytest.mark.parametrize("name", ["chatml", "llama3"])
def test_encoded_as_transformers_encodes_it(name, tmp_path):
    """The rendered text holds its special tokens: encoded with none added, it gives transformers' ids
    (one BOS, not two)."""
    path = checkpoint(tmp_path, TEMPLATES[name])
    text = load_chat_template(path, "k", "sys")("07+38=")
    expected = AutoTokenizer.from_pretrained(path).apply_chat_template(
        messages("07+38=", "sys"), tokenize=True, add_generation_prompt=True, return_dict=False
    )
    ids = char_tokenizer().encode(text, add_special_tokens=False)
    assert ids == list(expected)
    assert ids.count(char_tokenizer().bos_token_id) == (name == "llama3")


def test_named_templates_use_the_default_one(tmp_path):
    named = [{"name": "tool_use", "template": GEMMA}, {"name": "default", "template": CHATML}]
    path = checkpoint(tmp_path, named)
    assert load_chat_template(path, "k")("1+1=") == transformers_text(path, "1+1=")
    assert "<|im_start|>user\n1+1=" in transformers_text(path, "1+1=")


def test_chat_template_jinja_comes_before_tokenizer_config(tmp_path):
    path = checkpoint(tmp_path, CHATML, jinja_file=LLAMA3)
    chat = load_chat_template(path, "k")
    assert chat.source == LLAMA3 and chat("1+1=") == transformers_text(path, "1+1=")


def test_special_tokens_come_from_tokenizer_config(tmp_path):
    """Written as strings or as AddedToken dicts, and the model's own named tokens beside them."""
    template = "{{ bos_token }}|{{ eos_token }}|{{ image_token }}|{{ messages[0].content }}"
    path = checkpoint(
        tmp_path,
        template,
        bos_token={
            "__type": "AddedToken",
            "content": "<bos>",
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        },
        extra_special_tokens={"image_token": "<img>"},
    )
    chat = load_chat_template(path, "k")
    assert dict(chat.special_tokens) == {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                                   "image_token": "<img>"}  # fmt: skip
    assert chat("q") == "<bos>|<eos>|<img>|q" == transformers_text(path, "q")


def test_a_template_travels_to_other_processes(tmp_path):
    chat = load_chat_template(checkpoint(tmp_path, LLAMA3), "k", "sys")
    again = pickle.loads(pickle.dumps(chat))
    assert again == chat and again("1+1=") == chat("1+1=")


def test_the_trained_copy_keeps_the_template(tmp_path):
    for name, kwargs in (("config", {"template": CHATML}), ("jinja", {"template": None, "jinja_file": LLAMA3})):
        src = checkpoint(tmp_path / name / "src", **kwargs)
        dst = tmp_path / name / "dst"
        char_tokenizer().save(dst)  # what save_model writes: a tokenizer_config.json without a template
        assert copy_chat_template(src, dst)
        assert load_chat_template(dst, "k") == load_chat_template(src, "k")
    plain = checkpoint(tmp_path / "plain" / "src", None)
    assert not copy_chat_template(plain, tmp_path / "name" / "dst")


# -- errors ------------------------------------------------------------------------------------------


def error(path: Path, key: str = "task.chat_template", system: str | None = None) -> str:
    with pytest.raises(UserError) as info:
        load_chat_template(path, key, system)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_a_checkpoint_without_a_template_is_an_error_naming_the_key_and_the_directory(tmp_path):
    path = checkpoint(tmp_path / "plain", None)
    assert error(path) == (
        f"task.chat_template: {path} has no chat template (no chat_template in tokenizer_config.json, "
        "no chat_template.jinja); set task.chat_template.enabled=false or use a checkpoint that has one"
    )
    assert error(path, "judge.chat_template").startswith(f"judge.chat_template: {path} has no chat template")
    missing = tmp_path / "nowhere"
    assert error(missing) == f"task.chat_template: checkpoint directory {str(missing)!r} does not exist"


def test_templates_that_cannot_render_are_errors(tmp_path):
    gemma = checkpoint(tmp_path / "gemma", GEMMA)
    assert error(gemma, "judge.chat_template", "sys") == (
        f"judge.chat_template: the chat template of {gemma} fails to render with a system message: "
        "System role not supported"
    )
    broken = checkpoint(tmp_path / "broken", "{% for m in messages %}{{ m.content }}")
    assert error(broken).startswith(f"task.chat_template: the chat template of {broken} fails to render a prompt: ")
    named = checkpoint(tmp_path / "named", [{"name": "tool_use", "template": CHATML}, {"name": "rag", "template": ""}])
    assert (
        error(named) == f"task.chat_template: {named} has named chat templates (rag, tool_use) but none named 'default'"
    )
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer_config.json").write_text("{not json")
    assert error(bad).startswith(f"task.chat_template: {bad / 'tokenizer_config.json'} is not valid JSON")


def test_a_template_is_plain_values():
    chat = ChatTemplate("{{ bos_token }}{{ messages[0].content }}!", (("bos_token", "<s>"),))
    assert chat("hi") == "<s>hi!" and hash(chat) == hash(ChatTemplate(chat.source, chat.special_tokens))
