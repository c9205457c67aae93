"""Streamed text must equal the full decode and never show a half-built character."""
from __future__ import annotations

import random
import re

import pytest

from services.tokenizer.incremental_detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from tests.services.tokenizer.conftest import load_tokenizer

REAL_TEXTS = [
    "Hello, world! This is a plain ASCII sentence.",
    " Leading space, then  double  spaces and\ttabs\nand newlines.\n\n",
    "Emoji: 😀🚀🌍 family 👩‍👩‍👧 flag 🇯🇵 skin 👍🏽!",
    "中文：你好，世界。日本語のテキスト。한국어 문장입니다.",
    "Accents: naïve café crème brûlée Ærøskøbing Çağ ñandú — “quotes” …",
    "Mixed😀中a🚀b文c\u00e9\u0301d",
]


def _stream(tok, prompt_ids, output_ids, *, skip_special_tokens=True, step=1):
    """Feed `output_ids` `step` at a time; return the chunks (the last one from `finish`)."""
    expected = _expected(tok, prompt_ids, output_ids, skip_special_tokens)
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip_special_tokens)
    chunks = []
    for i in range(0, len(output_ids), step):
        chunks.append(detok.add(output_ids[i:i + step]))
        # Text once sent is never taken back, so it is the start of the final text; in
        # particular a chunk holds U+FFFD only where the final text does.
        assert expected.startswith("".join(chunks)), (output_ids[:i + step], chunks, expected)
    chunks.append(detok.finish())
    return chunks


def _expected(tok, prompt_ids, output_ids, skip_special_tokens=True):
    """The text the output adds to the prompt (with no prompt: decode(output_ids))."""
    full = tok.decode(list(prompt_ids) + list(output_ids), skip_special_tokens=skip_special_tokens)
    prompt_text = tok.decode(list(prompt_ids), skip_special_tokens=skip_special_tokens)
    assert full.startswith(prompt_text)
    return full[len(prompt_text):]


@pytest.mark.parametrize("text", REAL_TEXTS)
def test_real_text_without_prompt_equals_decode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    chunks = _stream(tok, [], ids)
    assert "".join(chunks) == tok.decode(ids)
    if REPLACEMENT_CHAR not in tok.decode(ids):
        assert not any(REPLACEMENT_CHAR in c for c in chunks)


@pytest.mark.parametrize("text", REAL_TEXTS)
def test_real_text_after_a_prompt_continues_it(tok, text):
    prompt = tok.encode("The answer is:")  # with bos where the tokenizer adds one
    ids = tok.encode(" " + text, add_special_tokens=False)
    for step in (1, 3):
        chunks = _stream(tok, prompt, ids, step=step)
        assert "".join(chunks) == _expected(tok, prompt, ids)
        assert not any(REPLACEMENT_CHAR in c for c in chunks)


def test_leading_space_is_kept_after_a_prompt(tok):
    # SentencePiece drops the space of the first token it decodes; after a prompt the
    # space belongs to the completion.
    prompt, full = tok.encode("Hello"), tok.encode("Hello world")
    assert full[:len(prompt)] == prompt
    assert "".join(_stream(tok, prompt, full[len(prompt):])) == " world"


BYTE_FALLBACK_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")


def _random_ids(tok, rng, n) -> list[int]:
    """Random tokens, a third of them pieces of multi-byte characters.

    Byte-level BPE decodes any byte string (broken characters become U+FFFD, the rest
    stays), so its pieces are drawn singly. SentencePiece byte fallback turns a whole
    run of byte tokens into U+FFFDs when the run is not valid UTF-8, even characters
    already streamed; a model only emits valid runs, so whole characters are drawn.
    """
    chars = "😀🚀🌍👍🏽中文你好世界日本語한국어éñçøß…—“”"
    byte_tokens = {i for i in range(tok.vocab_size)
                   if BYTE_FALLBACK_TOKEN.fullmatch(tok.tokenizer.id_to_token(i) or "")}
    pieces = sorted({i for c in chars for i in tok.encode(c, add_special_tokens=False)})
    ids: list[int] = []
    while len(ids) < n:
        if rng.random() < 0.35:
            if byte_tokens:
                ids += tok.encode(rng.choice(chars), add_special_tokens=False)
            else:
                ids.append(rng.choice(pieces))
        else:
            token = rng.randrange(tok.vocab_size)
            if token not in byte_tokens:
                ids.append(token)
    return ids


@pytest.mark.parametrize("seed", range(12))
def test_random_ids_equal_decode(tok, seed):
    ids = _random_ids(tok, random.Random(seed), 48)
    prompt = [] if seed % 2 else tok.encode("Say:")
    for skip in (True, False):
        chunks = _stream(tok, prompt, ids, skip_special_tokens=skip)
        assert "".join(chunks) == _expected(tok, prompt, ids, skip)


def test_split_character_is_held_back_then_released(tok):
    ids = tok.encode("🚀", add_special_tokens=False)
    if tok.decode(ids[:1]) == "🚀":
        pytest.skip("this tokenizer has the emoji as one token")
    detok = IncrementalDetokenizer(tok, [])
    chunks = [detok.add([i]) for i in ids]
    assert chunks[:-1] == [""] * (len(ids) - 1)
    assert "".join(chunks) == "🚀" and detok.finish() == ""


def test_finish_flushes_an_unfinished_character(tok):
    ids = tok.encode("a🚀", add_special_tokens=False)
    if tok.decode(ids[:-1]).endswith("🚀") or not tok.decode(ids[:-1]).endswith(REPLACEMENT_CHAR):
        pytest.skip("the emoji's last piece is not a separate byte token here")
    detok = IncrementalDetokenizer(tok, [])
    streamed = "".join(detok.add([i]) for i in ids[:-1])
    assert REPLACEMENT_CHAR not in streamed
    assert streamed + detok.finish() == tok.decode(ids[:-1])


def test_special_tokens_skipped_or_kept(demo_model_dir):
    tok = load_tokenizer(demo_model_dir)
    im_end = tok.token_to_id("<|im_end|>")
    ids = tok.encode("Hi there", add_special_tokens=False) + [im_end]
    assert "".join(_stream(tok, [], ids)) == "Hi there"
    assert "".join(_stream(tok, [], ids, skip_special_tokens=False)) == "Hi there<|im_end|>"


def test_output_token_ids_and_empty_add(demo_model_dir):
    tok = load_tokenizer(demo_model_dir)
    detok = IncrementalDetokenizer(tok, tok.encode("x"))
    assert detok.add([]) == ""
    ids = tok.encode(" ok", add_special_tokens=False)
    detok.add(ids)
    assert detok.output_token_ids == ids


class _CountingDecoder:
    """A real tokenizer whose decode calls are counted."""

    def __init__(self, tok):
        self.tok = tok
        self.calls = 0

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_the_first_token_decodes_once_the_prompts_tail_having_been_decoded_ahead(tok):
    # The gateway makes the detokenizer while the prompt computes: the first token's way out then
    # decodes only its window, and text held back (an unfinished character) is not decoded again.
    prompt = tok.encode("The answer is:")
    ids = tok.encode(" 😀 and more", add_special_tokens=False)
    counting = _CountingDecoder(tok)
    detok = IncrementalDetokenizer(counting, prompt)
    made = counting.calls
    chunks = [detok.add(ids[:1])]
    assert counting.calls == made + 1
    chunks += [detok.add([i]) for i in ids[1:]]
    chunks.append(detok.finish())
    assert "".join(chunks) == _expected(tok, prompt, ids)
