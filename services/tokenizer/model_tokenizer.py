"""A model directory's tokenizer: encode, decode, chat template, context length.

Reads what a Hugging Face model directory holds (`tokenizer.json`,
`tokenizer_config.json`, `chat_template.jinja`, `chat_templates/*.jinja`,
`generation_config.json`, `config.json`) with the Rust `tokenizers` library and
Jinja, never with `transformers`, which stays a test-only dependency. Where a
choice exists it is made as `transformers` 5.x makes it, so that a prompt
tokenized here equals the one `AutoTokenizer` gives.
"""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tokenizers import Tokenizer

from engine.encoder_config import position_offset
from services.tokenizer.chat_template import ChatTemplate, ChatTemplateError
from services.tokenizer.content_format import num_media_parts
from services.tokenizer.image_tokens import ImageRunTokens, ImageSize, PromptImageTokens, read_image_tokens

# The named special tokens transformers passes to every chat template (its
# SPECIAL_TOKENS_ATTRIBUTES), as strings, when set.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# config.json keys that bound the positions a model can attend over, first found wins.
CONTEXT_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "max_seq_len")
# transformers writes this huge sentinel as model_max_length when it means "no limit".
_NO_LIMIT = int(1e29)
# Requests' own templates kept compiled (compiling one takes milliseconds; a client sends the same
# few again and again), the least recently used dropped past this many.
MAX_REQUEST_TEMPLATES = 32


class ContextLengthError(ValueError):
    """A request's prompt plus its completion budget does not fit the model's context."""


def outside_vocabulary(token_ids: Sequence[int], vocab_size: int) -> str | None:
    """Why `token_ids` cannot be decoded (tokenizers silently drops unknown ids; a caller sending them
    has a bug worth hearing about), or None."""
    bad = next((i for i in token_ids if not 0 <= i < vocab_size), None)
    return None if bad is None else f"token id {bad} is outside the vocabulary [0, {vocab_size})"


class ModelTokenizer:
    """Tokenization and chat formatting for one model.

    Contract: `encode` / `decode` equal `tokenizers.Tokenizer.encode(...).ids` /
    `.decode(...)` on the model's tokenizer.json (which is what transformers'
    fast tokenizers call); `apply_chat_template` equals
    `AutoTokenizer.apply_chat_template(..., tokenize=True)`.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        chat_templates: Mapping[str, str] | None = None,
        eos_token_ids: Sequence[int] = (),
        max_model_len: int | None = None,
        image_tokens: PromptImageTokens | None = None,
    ):
        self.tokenizer = tokenizer
        self.special_tokens = dict(special_tokens or {})
        self._chat_template_sources = dict(chat_templates or {})
        self._compiled: dict[str, ChatTemplate] = {}
        self._request_templates: OrderedDict[str, ChatTemplate] = OrderedDict()
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))  # ordered, no repeats
        self.max_model_len = max_model_len
        self.image_tokens = image_tokens  # how a prompt holds an image; None: the model takes none

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike, *, max_model_len: int | None = None,
                 chat_template: str | None = None, hf_overrides: Mapping[str, Any] | None = None,
                 tokenizer_dir: str | os.PathLike | None = None) -> ModelTokenizer:
        """Load a Hugging Face model directory. `max_model_len` overrides the context
        length found in config.json (and may only shorten it); `chat_template` (Jinja source)
        replaces the model's templates, as vLLM's --chat-template does; `hf_overrides` replaces
        config.json's keys, as vLLM's --hf-overrides does; `tokenizer_dir`: where the tokenizer's
        files are (tokenizer.json, tokenizer_config.json, chat templates), when not in `model_dir`
        (vLLM's --tokenizer)."""
        model_path = Path(model_dir)
        path = Path(tokenizer_dir) if tokenizer_dir is not None else model_path
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json (only fast tokenizers are supported)")
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust library raises a bare Exception for a corrupt file
            raise ValueError(f"{tokenizer_file}: not a valid tokenizer.json ({e})") from e
        tok_config = _read_json(path / "tokenizer_config.json")
        model_config = {**_read_json(model_path / "config.json"), **(hf_overrides or {})}
        gen_config = _read_json(model_path / "generation_config.json")

        special_tokens = _special_tokens(tok_config)
        eos_ids = _eos_token_ids(tokenizer, special_tokens, model_config, gen_config)
        context = _context_length(model_config, tok_config)
        if max_model_len is not None:
            if max_model_len < 1 or (context is not None and max_model_len > context):
                raise ValueError(f"max_model_len={max_model_len} must be in [1, {context}] for {model_path}")
            context = max_model_len
        templates = {"default": chat_template} if chat_template is not None else _chat_templates(path, tok_config)
        processor = _read_json(path / "processor_config.json")
        if "image_processor" not in processor and (path / "preprocessor_config.json").is_file():
            # (as released: the image processor's settings in a file of their own, as the gateway reads them)
            processor["image_processor"] = _read_json(path / "preprocessor_config.json")
        image_tokens = read_image_tokens(tok_config, processor, model_config)
        return cls(tokenizer, special_tokens=special_tokens, chat_templates=templates,
                   eos_token_ids=eos_ids, max_model_len=context, image_tokens=image_tokens)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The same ids as `Tokenizer.encode`, which holds the GIL throughout (a 1 MB text stalls every
        # other thread, a server's event loop too, for 0.6 s here) and tracks offsets nothing reads:
        # the batch call without them lets go of the GIL and takes 25-30% less time.
        return self.tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_many(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Each of `texts` encoded as `encode` does, in one call."""
        return [e.ids for e in self.tokenizer.encode_batch_fast(list(texts), add_special_tokens=add_special_tokens)]

    def encode_pair(self, first: str, second: str) -> list[int]:
        """Two texts as one sequence, as the tokenizer's pair template joins them (a cross-encoder's input)."""
        return self.tokenizer.encode_batch_fast([(first, second)], add_special_tokens=True)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Raises ValueError for an id no u32 holds (the library's OverflowError)."""
        try:
            return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        except OverflowError:
            bad = next(i for i in ids if not 0 <= i < 2**32)
            raise ValueError(f"token id {bad} is outside the vocabulary (not a u32)") from None

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary's own string for `token_id` (e.g. "Ġthe"), not its decoded text."""
        return self.tokenizer.id_to_token(token_id)

    @property
    def has_chat_template(self) -> bool:
        return bool(self._chat_template_sources)

    @property
    def chat_templates(self) -> Mapping[str, str]:
        """Its templates' sources by name (a --chat-template replacing the model's is "default")."""
        return MappingProxyType(self._chat_template_sources)

    def chat_template(self, tools: Sequence[Any] | None = None, requested: str | None = None) -> ChatTemplate:
        """The template transformers would pick: `requested` (the name of one of several
        templates, else a template's source), else the only one, else "tool_use" when tools
        are given and one exists, else "default"."""
        sources = self._chat_template_sources
        if requested is not None and not (len(sources) > 1 and requested in sources):
            return self._request_template(requested)
        if not sources:
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
        if len(sources) == 1:
            name = next(iter(sources))
        elif requested is not None:
            name = requested
        elif tools is not None and "tool_use" in sources:
            name = "tool_use"
        elif "default" in sources:
            name = "default"
        else:
            raise ChatTemplateError(f"this model has several chat templates and none is named 'default': "
                                    f"{sorted(sources)}")
        if name not in self._compiled:
            self._compiled[name] = ChatTemplate(sources[name])
        return self._compiled[name]

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        add_special_tokens: bool = False,
        image_sizes: Sequence[ImageSize] | None = None,
        **kwargs: Any,
    ) -> tuple[str, list[int]]:
        """Render `messages` by `chat_template` (see `chat_template`; None: the model's) and encode
        the text, without adding special tokens unless `add_special_tokens` (the template writes bos
        itself, as transformers assumes); each {"type": "image"} part's mark made its image tokens, as many
        as its size in `image_sizes` (as its processor resized it) makes, for a model whose count depends on
        them (Mistral 3's), and its crops' runs beside it (Gemma 3's pan-and-scan); each {"type": "video"} part's
        its frames' (Qwen-VL's). Returns (text, ids).
        Raises `ChatTemplateError` (a ValueError) when the template does not compile or rejects them."""
        text = self.chat_template(tools, chat_template).render(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, documents=documents,
            continue_final_message=continue_final_message, special_tokens=self.special_tokens, **kwargs)
        num_items = sum(map(num_media_parts, messages))
        if num_items:  # each image's (and video's) mark made its run of tokens, as the model's processor does
            if self.image_tokens is None:
                raise ValueError("this model takes no images (its tokenizer names no image tokens)")
            if any(size.frames for size in image_sizes or ()) and not (
                    isinstance(self.image_tokens, ImageRunTokens) and self.image_tokens.video):
                raise ValueError("this model takes no videos here (Qwen-VL's do)")
            text = self.image_tokens.expanded(text, image_sizes, num_items)
        return text, self.encode(text, add_special_tokens=add_special_tokens)

    def _request_template(self, source: str) -> ChatTemplate:
        template = self._request_templates.pop(source, None) or ChatTemplate(source)
        self._request_templates[source] = template
        if len(self._request_templates) > MAX_REQUEST_TEMPLATES:
            self._request_templates.popitem(last=False)
        return template

    def check_context(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise `ContextLengthError` unless prompt + `max_tokens` fits the model's context."""
        self.completion_budget(num_prompt_tokens, max_tokens)

    def completion_budget(self, num_prompt_tokens: int, max_tokens: int | None) -> int | None:
        """How many tokens the completion may have: `max_tokens` when prompt + `max_tokens`
        fits, or what the context leaves when `max_tokens` is None (None: no known context,
        so no limit). Raises `ContextLengthError`, worded as OpenAI and vLLM word it."""
        limit = self.max_model_len
        if limit is None:
            return max_tokens
        if max_tokens is None:
            if num_prompt_tokens >= limit:  # a prompt that fills the context leaves no room for even one token
                raise ContextLengthError(
                    f"This model's maximum context length is {limit} tokens. However, your prompt has "
                    f"{num_prompt_tokens} tokens, which leaves no room for the completion. Please reduce the "
                    f"length of the prompt.")
            return limit - num_prompt_tokens
        if num_prompt_tokens + max_tokens > limit:
            raise ContextLengthError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for the "
                f"completion). Please reduce the length of the prompt or the completion.")
        return max_tokens


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json writes a special token as a string or as a serialized
    # AddedToken ({"content": "<s>", "__type": "AddedToken", ...}).
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _special_tokens(tok_config: Mapping[str, Any]) -> dict[str, str]:
    names = list(SPECIAL_TOKEN_NAMES)
    # transformers 5 adds the names of a dict of extra special tokens (e.g. image_token)
    # to the named ones, so templates see them too.
    extra = tok_config.get("extra_special_tokens")
    if isinstance(extra, Mapping):
        names += [name for name in extra if name not in names]
    tokens = {}
    for name in names:
        value = _token_content(tok_config.get(name, extra.get(name) if isinstance(extra, Mapping) else None))
        if value is not None:
            tokens[name] = value
    return tokens


def _chat_templates(path: Path, tok_config: Mapping[str, Any]) -> dict[str, str]:
    """Named templates; files (as transformers 5 saves them) win over tokenizer_config."""
    templates: dict[str, str] = {}
    configured = tok_config.get("chat_template")
    if isinstance(configured, str):
        templates["default"] = configured
    elif isinstance(configured, list):  # [{"name": ..., "template": ...}, ...]
        templates.update({t["name"]: t["template"] for t in configured})
    from_files = {}
    if (path / "chat_template.jinja").is_file():
        from_files["default"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
    if (path / "chat_templates").is_dir():
        for file in sorted((path / "chat_templates").glob("*.jinja")):
            from_files[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    return from_files or templates


def _eos_token_ids(tokenizer: Tokenizer, special_tokens: Mapping[str, str], model_config: Mapping[str, Any],
                   gen_config: Mapping[str, Any]) -> list[int]:
    # generation_config first: it lists every id that ends a turn (e.g. <|im_end|> and
    # <|endoftext|>), where tokenizer_config names only one.
    ids: list[int] = []
    for config in (gen_config, model_config):
        value = config.get("eos_token_id")
        ids += [value] if isinstance(value, int) else list(value or [])
    if "eos_token" in special_tokens and (eos := tokenizer.token_to_id(special_tokens["eos_token"])) is not None:
        ids.append(eos)
    return list(dict.fromkeys(ids))


def _context_length(model_config: Mapping[str, Any], tok_config: Mapping[str, Any]) -> int | None:
    for config in (model_config, model_config.get("text_config") or {}):
        for key in CONTEXT_LENGTH_KEYS:
            if isinstance(config.get(key), int):
                return config[key] - position_offset(config)
    limit = tok_config.get("model_max_length")
    if isinstance(limit, (int, float)) and 0 < limit < _NO_LIMIT:
        return int(limit)
    return None
