"""vLLM's `GET /tokenizer_info` (--enable-tokenizer-info-endpoint, off by default as in vLLM: it shows
the chat template, which an operator may keep to themselves): the tokenizer's configuration, for
clients that tokenize, render or constrain output on their side and must do it as the server does.

What the model's tokenizer_config.json says, as transformers loads it (a special token as its text,
added_tokens_decoder as {id: text}), without the paths of files, with the chat template the gateway
renders by (--chat-template's, where given; several as transformers saves them, a list of
{"name", "template"}) and the tokenizer's class.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

FILE_FIELDS = frozenset({"vocab_file", "merges_file", "tokenizer_file"})
DEFAULT_CLASS = "PreTrainedTokenizerFast"  # what transformers loads a tokenizer.json as when the config names none


def tokenizer_info(model_dir: Path, chat_templates: Mapping[str, str]) -> dict[str, Any]:
    path = Path(model_dir) / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    info = {name: _as_text(value) for name, value in config.items() if name not in FILE_FIELDS}
    info.pop("chat_template", None)
    if len(chat_templates) == 1:
        info["chat_template"] = next(iter(chat_templates.values()))
    elif chat_templates:
        info["chat_template"] = [{"name": name, "template": source} for name, source in chat_templates.items()]
    info["tokenizer_class"] = config.get("tokenizer_class") or DEFAULT_CLASS
    return info


def _as_text(value: Any) -> Any:
    """A serialized AddedToken (any object with a text `content`) as its text, at any depth."""
    if isinstance(value, Mapping):
        if isinstance(value.get("content"), str):
            return value["content"]
        return {key: _as_text(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_as_text(item) for item in value]
    return value


def add_tokenizer_info_route(app: FastAPI, info: dict[str, Any]) -> None:
    async def tokenizer_info_endpoint() -> JSONResponse:
        return JSONResponse(info)

    app.add_api_route("/tokenizer_info", tokenizer_info_endpoint, methods=["GET"])
