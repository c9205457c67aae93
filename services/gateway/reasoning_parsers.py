"""A reasoning model's thinking, read out of its text into `reasoning` (`--reasoning-parser`).

Reasoning models think between `<think>` and `</think>` before they answer. The parser names
how the served model does it, as vLLM's `--reasoning-parser` does:
- `deepseek_r1` (DeepSeek-R1 and its distills, QwQ): the text is thinking until `</think>`,
  with or without a `<think>` to open it (R1 often leaves it out, or its template writes it);
- `qwen3` (Qwen3): the text is thinking only where a `<think>` opens it, in the text or at the
  end of the prompt (Qwen3 writes it itself unless `enable_thinking` is false; its 2507
  thinking models' template writes it into the prompt); `glm45` (GLM-4.5 to 4.7) reads the same way,
  and so does `deepseek_v3` (DeepSeek-V3.1 and V3.2, whose template ends the prompt with `<think>`
  when `chat_template_kwargs` has `thinking` true, with `</think>` otherwise: vLLM's reads R1's way
  or not at all by that same switch);
- `seed_oss` (Seed-OSS): as `qwen3`, between `<seed:think>` and `</seed:think>`;
- `step3p5` (Step-3.5 and 3.7, whose template always opens the thinking): as `deepseek_r1`, the thinking's
  trailing whitespace dropped (the model closes it with `\n</think>\n`), as vLLM's reads it;
- `openai_gptoss` (gpt-oss): no tags but harmony's channels, read by harmony.py; a guided reply
  thinks freely and is guided from the token after `<|channel|>final<|message|>`, where the
  tokenizer has `<|channel|>` and `<|message|>` as tokens (gpt-oss's does), else from the first token
  (and is then all answer).
What follows `</think>` is the answer (`content`). A text cut short while thinking is all
reasoning, with no content.

A guided reply (structured output, a guided regex) thinks freely and is guided from the token
after its `</think>`, as vLLM guides only the answer: the gateway asks the worker's guide to
wait for that token (`guide_after`), unless the prompt has closed the thinking already (Qwen3
with `enable_thinking` false) or the tokenizer has no single token for `</think>`. Then the
guide holds from the first token, and the reply is the answer unless its pattern writes
`<think>` itself. A forced tool call is never read for thinking.

Streaming: each delta is split as it comes; what could still be the start of a tag is held
back until the next delta says, as stop strings are.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.gateway.call_text import begun_tag_length
from services.gateway.harmony import CHANNEL as HARMONY_CHANNEL, MESSAGE as HARMONY_MESSAGE, HarmonyReasoning

PARSERS = ("deepseek_r1", "qwen3", "glm45", "deepseek_v3", "seed_oss", "step3p5", "openai_gptoss")
# Those that drop the thinking's trailing whitespace.
STRIPPED = ("step3p5",)
HARMONY = "openai_gptoss"
# SGLang's names (its --reasoning-parser) for the parsers above that read as its own do: its
# `qwen3-thinking` and `step3` read thinking from the first token, as `deepseek_r1` does, its
# `minimax` as `qwen3`.
SGLANG_NAMES = {"deepseek-r1": "deepseek_r1", "deepseek-v3": "deepseek_v3", "gpt-oss": HARMONY,
                "qwen3-thinking": "deepseek_r1", "step3": "deepseek_r1", "minimax": "qwen3"}
PROMPT_TAIL_TOKENS = 8  # enough to hold "<think>\n" however a tokenizer splits it


@dataclass(frozen=True)
class ThinkTags:
    """What opens and closes a model's thinking."""

    start: str = "<think>"
    end: str = "</think>"

    def prompt_opens(self, prompt_tail: str) -> bool:
        """Whether the prompt ends inside a think block its template opened."""
        return prompt_tail.rfind(self.start) > prompt_tail.rfind(self.end)

    def prompt_closes(self, prompt_tail: str) -> bool:
        """Whether the prompt ends after a think block its template closed (thinking switched off)."""
        return prompt_tail.rfind(self.end) > prompt_tail.rfind(self.start)


THINK = ThinkTags()
TAGS = {"seed_oss": ThinkTags("<seed:think>", "</seed:think>")}  # the others': THINK


def parser_named(name: str) -> str:
    """The parser `name` names, by vLLM's name or SGLang's (one neither knows, as it is)."""
    return SGLANG_NAMES.get(name, name)


def tags_of(parser: str) -> ThinkTags:
    return TAGS.get(parser, THINK)


def starts_thinking(parser: str, prompt_tail: str, is_guided_from_start: bool) -> bool | None:
    """How a reply starts: thinking (True), answering (False), or as its first characters will say
    (None: thinking if they open a think block)."""
    tags = tags_of(parser)
    if is_guided_from_start or tags.prompt_closes(prompt_tail):
        return None
    if parser in ("deepseek_r1", "step3p5") or tags.prompt_opens(prompt_tail):
        return True
    return None


@dataclass
class StreamedReasoning:
    """One choice's text split into thinking and answer: `add` each delta, `finish` at the end."""

    is_thinking: bool | None  # None: undecided, the text may still open a think block
    tags: ThinkTags = THINK
    strips_whitespace: bool = False  # the thinking's trailing whitespace dropped (held back until text follows it)
    has_thought: bool = False  # some of the text was thinking (a reply with none has no `reasoning`)
    _held: str = ""
    _is_at_start: bool = True  # a `<think>` here opens the thinking (or, begun already, is dropped)

    def add(self, delta: str) -> tuple[str, str]:
        """(thinking, answer) to send now."""
        text, self._held = self._held + delta, ""
        start, end_tag = self.tags.start, self.tags.end
        if self._is_at_start:
            stripped = text.lstrip()
            if stripped.startswith(start):
                self.is_thinking, text = True, stripped[len(start):]
            elif start.startswith(stripped):  # blank, or a possible start of the tag: wait
                self._held = text
                return "", ""
            elif self.is_thinking is None:
                self.is_thinking = False
            self._is_at_start = False
        if not self.is_thinking:
            return "", text
        self.has_thought = True
        end = text.find(end_tag)
        if end == -1:
            keep = begun_tag_length(text, end_tag)
            if self.strips_whitespace:
                keep = len(text) - len(text[:len(text) - keep].rstrip())
            self._held = text[len(text) - keep:]
            return text[:len(text) - keep], ""
        self.is_thinking = False
        thought = text[:end].rstrip() if self.strips_whitespace else text[:end]
        return thought, text[end + len(end_tag):]

    def finish(self) -> tuple[str, str]:
        """(thinking, answer) still held: a tag never completed is text."""
        held, self._held = self._held, ""
        if not self.is_thinking:
            return "", held
        return (held.rstrip() if self.strips_whitespace else held), ""


def separated(parser: str, text: str) -> tuple[str, str]:
    """A whole reply's (thinking, answer) under `parser`, read as a chat reply is with its prompt unknown."""
    stream = HarmonyReasoning() if parser == HARMONY else StreamedReasoning(starts_thinking(parser, "", False),
                                                                            tags_of(parser), parser in STRIPPED)
    thought, answer = stream.add(text)
    more_thought, more_answer = stream.finish()
    return thought + more_thought, answer + more_answer


@dataclass(frozen=True)
class ReasoningReader:
    """What reads one request's replies: `parser` (one of PARSERS), `decode` (token ids to text),
    `is_guided` (the request's text is held to a pattern), `end_token_ids` (the tokens that end the
    thinking, where the tokenizer writes them as tokens of their own: `</think>`'s one, harmony's
    `<|channel|>final<|message|>`)."""

    parser: str
    decode: Callable[[list[int]], str]
    is_guided: bool = False
    end_token_ids: tuple[int, ...] | None = None
    decode_text: Callable[[list[int]], str] | None = None  # as the reply's text has them: special tokens left out

    @property
    def reads_special_tokens(self) -> bool:
        """Harmony's channels are marked by special tokens, which the text must keep."""
        return self.parser == HARMONY

    def stream(self, prompt_token_ids: Sequence[int]) -> StreamedReasoning | HarmonyReasoning:
        """What splits one reply to `prompt_token_ids` as it streams."""
        if self.parser == HARMONY:
            return HarmonyReasoning()
        return StreamedReasoning(self.start(prompt_token_ids), tags_of(self.parser), self.parser in STRIPPED)

    def guide_after(self, prompt_token_ids: Sequence[int]) -> tuple[int, ...] | None:
        """The tokens a guided reply's guide waits for: the end of its thinking. None: the guide holds
        from the first token."""
        if not self.is_guided or self.end_token_ids is None:
            return None
        if self.parser == HARMONY:
            return self.end_token_ids
        return self._guide_after(self._tail(prompt_token_ids))

    def start(self, prompt_token_ids: Sequence[int]) -> bool | None:
        """How a reply to `prompt_token_ids` starts (`starts_thinking`)."""
        tail = self._tail(prompt_token_ids)
        is_guided_from_start = self.is_guided and (self.end_token_ids is None or self._guide_after(tail) is None)
        return starts_thinking(self.parser, tail, is_guided_from_start)

    def tokens_after_close(self, token_ids: Sequence[int], num_new: int) -> int | None:
        """Of a reply's `token_ids` so far, whose last `num_new` are a delta's, how many of those follow the
        tokens that end the thinking, where they end among them (begun in an earlier delta or not); None
        where they do not, or the tokenizer has no such tokens. By the tokens, not the text: a delta's text
        is held back while its last character is incomplete, the close's with it."""
        ends = self.end_token_ids
        if not ends:
            return None
        for at in range(max(len(token_ids) - num_new - len(ends) + 1, 0), len(token_ids) - len(ends) + 1):
            if tuple(token_ids[at:at + len(ends)]) == ends:
                return len(token_ids) - at - len(ends)
        return None

    def num_answer_tokens(self, token_ids: Sequence[int], answer: str) -> int:
        """Of `token_ids`, a delta in which the thinking ended and `answer` began, how many at its end
        are the answer's: those after the tokens that end the thinking where the tokenizer has them as
        tokens (whether their text is out yet or not: a character held back, whitespace a parser
        drops), else as many as the answer's text holds (the one that completes the end is thinking's)."""
        if len(token_ids) < 2:
            return 0
        ends = self.end_token_ids
        if ends:
            for at in range(len(token_ids) - len(ends) + 1):
                if tuple(token_ids[at:at + len(ends)]) == ends:
                    return len(token_ids) - at - len(ends)
        if not answer:
            return 0
        decode = self.decode_text or self.decode
        fewest, most = 0, len(token_ids) - 1  # a longer tail writes more text: the longest that fits
        while fewest < most:
            num = (fewest + most + 1) // 2
            if len(decode(list(token_ids[-num:]))) <= len(answer):
                fewest = num
            else:
                most = num - 1
        return fewest

    def _guide_after(self, prompt_tail: str) -> tuple[int, ...] | None:
        return None if tags_of(self.parser).prompt_closes(prompt_tail) else self.end_token_ids

    def _tail(self, prompt_token_ids: Sequence[int]) -> str:
        return self.decode(list(prompt_token_ids[-PROMPT_TAIL_TOKENS:]))


def reasoning_reader(parser: str | None, tokenizer, is_guided: bool) -> ReasoningReader | None:
    """The reader of a chat request's replies under `parser` (None: no parser, none), over the model's
    `tokenizer` (its `decode` and `token_to_id`)."""
    if parser is None:
        return None
    return ReasoningReader(parser, lambda ids: tokenizer.decode(ids, skip_special_tokens=False), is_guided,
                           _end_token_ids(parser, tokenizer), lambda ids: tokenizer.decode(ids))


def _end_token_ids(parser: str, tokenizer) -> tuple[int, ...] | None:
    """The tokens that end a reply's thinking, where the tokenizer has its markers as tokens."""
    if parser == HARMONY:
        channel, message = tokenizer.token_to_id(HARMONY_CHANNEL), tokenizer.token_to_id(HARMONY_MESSAGE)
        if channel is None or message is None:
            return None
        return (channel, *tokenizer.encode("final", add_special_tokens=False), message)
    end = tokenizer.token_to_id(tags_of(parser).end)
    return None if end is None else (end,)
