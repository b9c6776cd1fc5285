"""Chat templates rendered as transformers renders them, without importing transformers.

A checkpoint's template (``chat_template`` in ``tokenizer_config.json``, or a ``.jinja`` file
given with ``--chat-template-path``) is rendered by jinja2 in a sandbox with transformers'
settings (``trim_blocks``, ``lstrip_blocks``, its ``tojson`` filter and ``raise_exception``), so
the text is the one ``apply_chat_template(..., tokenize=False)`` would give for the same messages
and tools. Importing transformers costs seconds of CPU per process; jinja2 is already a
dependency of it.

:data:`CHATML_TOOLS_TEMPLATE` is Qwen3's layout (ChatML turns, a tools block in the system turn,
``<tool_call>`` JSON in assistant turns, tool answers as ``<tool_response>`` inside a user turn,
reasoning blocks dropped from assistant history) for checkpoints that carry no template, such as
the project's tiny test model.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from miles_disagg.types import ConfigError, InvalidInput

CHATML_TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{ '# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '"
    " + '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": '"
    " + '<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = (message.content or '').split('</think>')[-1].lstrip('\\n') %}"
    "{{ '<|im_start|>assistant\\n' + content }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- if content or not loop.first %}{{ '\\n' }}{%- endif %}"
    "{%- set args = call.function.arguments %}"
    "{{ '<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{{- args if args is string else (args | tojson) }}{{ '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def checkpoint_template(model_dir: str | Path, template_path: str | Path | None = None) -> str:
    """The chat template to render: ``template_path``'s text, else the checkpoint's, else
    :data:`CHATML_TOOLS_TEMPLATE` (a checkpoint without one). ``ConfigError`` for an unreadable file."""
    if template_path is not None:
        try:
            return Path(template_path).read_text()
        except OSError as exc:
            raise ConfigError(f"--chat-template-path {str(template_path)!r}: {exc}", ("--chat-template-path",)) from None
    config = Path(model_dir) / "tokenizer_config.json"
    template = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
    if isinstance(template, list):  # transformers' named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) and template else CHATML_TOOLS_TEMPLATE


def render(template: str, messages: list[dict[str, Any]], *, tools: list[dict] | None = None,
           add_generation_prompt: bool = False, **kwargs: Any) -> str:
    """``template`` rendered for ``messages`` (and ``tools``), as transformers' ``apply_chat_template``
    with ``tokenize=False``. ``InvalidInput`` when the template refuses them."""
    from jinja2 import TemplateError

    try:
        return _compiled(template).render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                          **kwargs)
    except TemplateError as exc:
        raise InvalidInput(f"the chat template cannot render these messages: {exc}") from None


@lru_cache(maxsize=8)
def _compiled(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        from jinja2 import TemplateError

        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)
