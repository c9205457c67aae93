"""Logprobs in the shapes the `openai` client parses: the legacy completions lists (a generated
part's, an echoed prompt's, and the two joined), chat's `content` list, and vLLM's
`prompt_logprobs`.

An echoed prompt's tokens come first in a completion's logprobs, the first with none (nothing
predicts it), as OpenAI's legacy API and vLLM list them: what evaluation harnesses score a text by.
vLLM's `prompt_logprobs` are None for the first token, then per token its id →
`{logprob, rank, decoded_token}` for the top-n and the prompt's own token (its rank null when it
is not among them)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from protos import common_pb2

TokenText = Callable[[int], str]  # a token id as the text it decodes to on its own


def completion_logprobs(entries: Sequence[common_pb2.TopLogprobs], token_text: TokenText,
                        text_offset: int) -> dict[str, Any]:
    """The legacy completions shape: parallel lists, `text_offset` counted from `text_offset`."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for entry in entries:
        text = token_text(entry.sampled.token_id)
        tokens.append(text)
        token_logprobs.append(entry.sampled.logprob)
        top.append({token_text(t.token_id): t.logprob for t in entry.top})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def echoed_logprobs(prompt_token_ids: Sequence[int], entries: Sequence[common_pb2.TopLogprobs], n: int,
                    token_text: TokenText) -> dict[str, Any]:
    """The prompt's part of an echoed completion's logprobs, `text_offset` counted from 0."""
    texts = [token_text(t) for t in prompt_token_ids]
    offsets = [0]
    for text in texts[:-1]:
        offsets.append(offsets[-1] + len(text))
    return {"tokens": texts, "token_logprobs": [None, *(e.sampled.logprob for e in entries)],
            "top_logprobs": [None, *({token_text(t.token_id): t.logprob for t in e.top[:n]} for e in entries)],
            "text_offset": offsets}


def joined_logprobs(first: dict[str, list], then: dict[str, list]) -> dict[str, list]:
    """Two legacy logprobs objects as one: each of their parallel lists, one after the other."""
    return {key: first[key] + then[key] for key in first}


def vllm_prompt_logprobs(entries: Sequence[common_pb2.TopLogprobs], n: int,
                         token_text: TokenText) -> list[dict[str, Any] | None]:
    out: list[dict[str, Any] | None] = [None]
    for entry in entries:
        record = {str(t.token_id): {"logprob": t.logprob, "rank": rank, "decoded_token": token_text(t.token_id)}
                  for rank, t in enumerate(entry.top[:n], start=1)}
        sampled = entry.sampled
        record.setdefault(str(sampled.token_id), {"logprob": sampled.logprob, "rank": None,
                                                  "decoded_token": token_text(sampled.token_id)})
        out.append(record)
    return out


def chat_logprobs(entries: Sequence[common_pb2.TopLogprobs], token_text: TokenText) -> dict[str, Any]:
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**one(e.sampled.token_id, e.sampled.logprob),
                         "top_logprobs": [one(t.token_id, t.logprob) for t in e.top]} for e in entries],
            "refusal": None}
