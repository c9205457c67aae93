"""`--chat-template`: the served model's chat template replaced, as vLLM's flag replaces it.

The tokenizer service and the gateway both render conversations (the gateway the short ones
itself), so both take the flag and read the same shared variable: a template set for one and
not the other would give one conversation two prompts.
"""
from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path

from services.common.settings import ConfigError
from services.tokenizer.chat_template import ChatTemplate, ChatTemplateError

ENV_CHAT_TEMPLATE = "BATON_CHAT_TEMPLATE"
# What marks a value as a template written out rather than a file's path (vLLM's test).
_TEMPLATE_CHARS = ("{", "\n")


def add_chat_template_flag(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    parser.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE", default=env.get(ENV_CHAT_TEMPLATE) or None,
                        help=f"render chat conversations by this Jinja template (a file, or the template itself) "
                             f"instead of the model's own (${ENV_CHAT_TEMPLATE}); give the gateway and the "
                             f"tokenizer service the same one")


def chat_template_source(value: str | None) -> str | None:
    """The template `--chat-template` names: a file's text, or the value itself where it is a
    template. Raises ConfigError for a path to no file, or a template that does not compile."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--chat-template {value}: cannot read it ({e})") from None
    elif any(c in value for c in _TEMPLATE_CHARS):
        source = value
    else:
        raise ConfigError(f"--chat-template {value!r}: no such file, and not a Jinja template (${ENV_CHAT_TEMPLATE})")
    try:
        ChatTemplate(source)
    except ChatTemplateError as e:
        raise ConfigError(f"--chat-template: {e}") from None
    return source
