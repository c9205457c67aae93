"""A reasoning model's thinking, read out of its text into `reasoning` (`--reasoning-parser`).

Reasoning models think between `<think>` and `</think>` before they answer. The parser names
how the served model does it, as vLLM's `--reasoning-parser` does:
- `deepseek_r1` (DeepSeek-R1 and its distills, QwQ): the text is thinking until `</think>`,
  with or without a `<think>` to open it (R1 often leaves it out, or its template writes it);
- `qwen3` (Qwen3): the text is thinking only where a `<think>` opens it, in the text or at the
  end of the prompt (Qwen3 writes it itself unless `enable_thinking` is false; its 2507
  thinking models' template writes it into the prompt).
What follows `</think>` is the answer (`content`). A text cut short while thinking is all
reasoning, with no content.

A guided text (structured output, a guided regex, a forced tool call) is the answer from its
first token: it is thinking only where it writes `<think>` itself. (vLLM guides only the
text after the thinking; Baton's guide holds from the first token, so such a text has none
unless its pattern writes it.)

Streaming: each delta is split as it comes; what could still be the start of a tag is held
back until the next delta says, as stop strings are.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")
PROMPT_TAIL_TOKENS = 8  # enough to hold "<think>\n" however a tokenizer splits it


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """Whether the prompt ends inside a think block its template opened."""
    return prompt_tail.rfind(START) > prompt_tail.rfind(END)


def starts_thinking(parser: str, prompt_tail: str, is_guided: bool) -> bool | None:
    """How a reply starts: thinking (True), answering (False), or as its first characters will say
    (None: thinking if they open a think block)."""
    if is_guided:
        return None
    if parser == "deepseek_r1" or prompt_opens_thinking(prompt_tail):
        return True
    return None


@dataclass
class StreamedReasoning:
    """One choice's text split into thinking and answer: `add` each delta, `finish` at the end."""

    is_thinking: bool | None  # None: undecided, the text may still open a think block
    has_thought: bool = False  # some of the text was thinking (a reply with none has no `reasoning`)
    _held: str = ""
    _is_at_start: bool = True  # a `<think>` here opens the thinking (or, begun already, is dropped)

    def add(self, delta: str) -> tuple[str, str]:
        """(thinking, answer) to send now."""
        text, self._held = self._held + delta, ""
        if self._is_at_start:
            stripped = text.lstrip()
            if stripped.startswith(START):
                self.is_thinking, text = True, stripped[len(START):]
            elif START.startswith(stripped):  # blank, or a possible start of the tag: wait
                self._held = text
                return "", ""
            elif self.is_thinking is None:
                self.is_thinking = False
            self._is_at_start = False
        if not self.is_thinking:
            return "", text
        self.has_thought = True
        end = text.find(END)
        if end == -1:
            keep = _partial_tag(text, END)
            self._held = text[len(text) - keep:]
            return text[:len(text) - keep], ""
        self.is_thinking = False
        return text[:end], text[end + len(END):]

    def finish(self) -> tuple[str, str]:
        """(thinking, answer) still held: a tag never completed is text."""
        held, self._held = self._held, ""
        return (held, "") if self.is_thinking else ("", held)


def split_reasoning(text: str, is_thinking: bool | None) -> tuple[str | None, str | None]:
    """A whole reply's (reasoning, content): reasoning None where it did not think; content None
    where it thought and gave no answer."""
    stream = StreamedReasoning(is_thinking)
    parts = [stream.add(text), stream.finish()]
    reasoning = "".join(p[0] for p in parts)
    content = "".join(p[1] for p in parts)
    if not stream.has_thought:
        return None, content
    return reasoning, content or None


def _partial_tag(text: str, tag: str) -> int:
    """How many of `text`'s last characters could be the start of `tag`."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:n])), 0)


def prompt_tail_text(decode, prompt_token_ids: Sequence[int]) -> str:
    """The prompt's last tokens as text, where a template's opening `<think>` would be."""
    return decode(list(prompt_token_ids[-PROMPT_TAIL_TOKENS:]))


@dataclass(frozen=True)
class ReasoningReader:
    """What reads one request's replies: `parser` (one of PARSERS), `decode` (token ids to text),
    `is_guided` (the request's text is guided from its first token)."""

    parser: str
    decode: Callable[[list[int]], str]
    is_guided: bool = False

    def start(self, prompt_token_ids: Sequence[int]) -> bool | None:
        """How a reply to `prompt_token_ids` starts (`starts_thinking`)."""
        return starts_thinking(self.parser, prompt_tail_text(self.decode, prompt_token_ids), self.is_guided)
