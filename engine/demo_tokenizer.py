"""The demo model's tokenizer: a byte-level BPE trained on a Python standard library, with Llama 3's
bos and end-of-text tokens and ChatML's turn markers (engine/demo_model.py writes it out as
tokenizer.json). Nothing here imports `transformers`: it stays a test-only dependency.

Up to SHIPPED_VOCAB_SIZE tokens it is the shipped demo_tokenizer.json's first ones, trained once on
Python 3.11's library (`python -m engine.demo_tokenizer` writes it again): trained on the running
Python's, each version's library gives another tokenizer, so another demo model, and the tests'
expectations of the model held on one Python alone (on 3.12, five end-to-end tests failed so). A
BPE's first merges are those of a smaller one trained on the same text, so the first tokens of the
shipped one are exactly what training for fewer would give. Larger ones are trained here.
"""
from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# Trained first, so they take ids 0..3 whatever the corpus holds.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
# With think_tokens: ordinary added tokens, the last two ids, as Qwen3's and DeepSeek-R1's tokenizers have them.
THINK_TOKENS = ("<think>", "</think>")

# ChatML turns. The template writes bos itself and the rendered text is encoded
# without special tokens (as transformers' apply_chat_template does), like Llama 3.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# The corpus is the running Python's own standard library, so it is on every
# machine and needs no download. It changes with the Python version, and so does
# the tokenizer; on one interpreter it is byte-for-byte reproducible.
CORPUS_MAX_BYTES = 4_000_000
CORPUS_MAX_BYTES_PER_FILE = 12 * 1024  # the head of every module (docstrings!) beats all of a few
# Tests and installed packages are not the stdlib; encodings/ is mostly generated
# code-page tables; config-*/ holds build-specific files.
CORPUS_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
                              "encodings"})


SHIPPED = Path(__file__).with_name("demo_tokenizer.json")
SHIPPED_VOCAB_SIZE = 8192  # the demo model's default vocabulary


def demo_tokenizer(vocab_size: int) -> Tokenizer:
    """The demo tokenizer of `vocab_size` tokens: the shipped one's first, where it has that many."""
    if vocab_size > SHIPPED_VOCAB_SIZE:
        return train_tokenizer(vocab_size)
    shipped = json.loads(SHIPPED.read_text())
    model = shipped["model"]
    num_unmerged = len(model["vocab"]) - len(model["merges"])  # the special tokens and the byte alphabet
    if vocab_size < num_unmerged:  # training keeps them all, whatever it is asked for
        return train_tokenizer(vocab_size)
    model["vocab"] = {token: i for token, i in model["vocab"].items() if i < vocab_size}
    model["merges"] = model["merges"][:vocab_size - num_unmerged]
    return Tokenizer.from_str(json.dumps(shipped))


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE (GPT-2 / Llama 3 style) trained on the running Python's standard library.

    Encoding with special tokens prepends bos, as Llama 3's tokenizer does.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A",
            pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
            special_tokens=[(BOS_TOKEN, bos_id)],
        ),
    ])
    return tokenizer


def _corpus() -> list[str]:
    """Standard-library sources in sorted path order, capped in total and per file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in CORPUS_SKIP_DIRS and not d.startswith("config-")]
        paths += [Path(dirpath, f) for f in filenames
                  # _sysconfigdata holds build paths and flags: it would make the tokenizer machine-dependent.
                  if f.endswith(".py") and not f.startswith("_sysconfigdata")]
    paths.sort(key=lambda p: p.relative_to(root).as_posix())
    texts, total = [], 0
    for p in paths:
        if total >= CORPUS_MAX_BYTES:
            break
        data = p.read_bytes()[: min(CORPUS_MAX_BYTES_PER_FILE, CORPUS_MAX_BYTES - total)]
        texts.append(data.decode("utf-8", errors="ignore"))  # a cut may split a character
        total += len(data)
    if not texts:
        raise RuntimeError(f"no Python sources found under {root} to train the demo tokenizer on")
    return texts


if __name__ == "__main__":
    # Run on Python 3.11 only: another version's library would change every demo model.
    SHIPPED.write_text(train_tokenizer(SHIPPED_VOCAB_SIZE).to_str())
