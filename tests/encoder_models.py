"""Tiny BERT-family embedding models made by `transformers` itself, with a real WordPiece
tokenizer.json and, where asked, a sentence-transformers Pooling module: what a directory of
all-MiniLM-L6-v2 or bge-small looks like, small enough for a test."""
from __future__ import annotations

import json
import string
from pathlib import Path

import torch

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "cat", "sat", "on", "mat", "a", "is", "and",
         "then", "red", "green", "blue", "sky", "sea", "sun", "moon", "star"]
POSITIONS = 2050  # a test mesh's decode pool (2048 tokens) fits in its context, as a decoder's does
POOLING_KEYS = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "last": "pooling_mode_lasttoken"}


def make_encoder(path: Path, architecture: str = "BertModel", pooling: str | None = "mean",
                 num_labels: int = 2, **modernbert: object) -> Path:
    """A 2-layer encoder of `architecture` (BertModel, XLMRobertaModel, ModernBertModel (4 layers:
    global, two sliding, global), or their *ForSequenceClassification with `num_labels`) in `path`;
    `pooling`: its sentence-transformers Pooling module's mode, None for a directory without one (and
    a ModernBERT classifier's classifier_pooling); `modernbert`: more of a ModernBertConfig's fields."""
    import transformers
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    path.mkdir(parents=True, exist_ok=True)
    # More than the 98 token ids a worker's warm-up prompts use.
    pieces = string.ascii_lowercase + string.digits
    vocab = SPECIAL + WORDS + list(pieces) + [f"##{c}" for c in pieces] + list(".,!?")
    ids = {token: i for i, token in enumerate(vocab)}
    tokenizer = Tokenizer(WordPiece(ids, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    is_bert = architecture.startswith("Bert")  # RoBERTa's pairs: "<s> A </s></s> B </s>", of one token type
    is_modern = architecture.startswith("ModernBert")  # ModernBERT's: "[CLS] A [SEP] B [SEP]", of one type
    pair = "[CLS] $A [SEP] $B:1 [SEP]:1" if is_bert else "[CLS] $A [SEP] $B [SEP]" if is_modern else \
        "[CLS] $A [SEP] [SEP] $B [SEP]"
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair=pair, special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "BertTokenizer", "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]",
        "unk_token": "[UNK]", "mask_token": "[MASK]", "model_max_length": POSITIONS}))
    common = dict(vocab_size=len(vocab), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, initializer_range=0.2)
    if is_modern:  # a window of 4 tokens either side: a 9-token prompt already shows it
        common.update(num_hidden_layers=4, intermediate_size=96)
        config = transformers.ModernBertConfig(max_position_embeddings=POSITIONS, pad_token_id=0, bos_token_id=2,
                                               eos_token_id=3, cls_token_id=2, sep_token_id=3, num_labels=num_labels,
                                               local_attention=8, classifier_pooling=pooling or "cls",
                                               **{**common, **modernbert})
    elif is_bert:
        config = transformers.BertConfig(max_position_embeddings=POSITIONS, pad_token_id=0, num_labels=num_labels,
                                         **common)
    else:  # positions after the padding index, as RoBERTa's
        config = transformers.XLMRobertaConfig(max_position_embeddings=POSITIONS + 1, pad_token_id=0, bos_token_id=2,
                                               eos_token_id=3, num_labels=num_labels, type_vocab_size=1, **common)
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config).eval()
    with torch.no_grad():  # noisy norms and biases: one ignored shows in the output
        for name, param in model.named_parameters():
            if "LayerNorm" in name or "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(path)
    if pooling is not None and architecture.endswith("Model"):
        (path / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
        (path / "1_Pooling").mkdir(exist_ok=True)
        (path / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": 64, **{key: mode == pooling for mode, key in POOLING_KEYS.items()}}))
    return path


def transformers_embedding(model_dir: Path, token_ids: list[int], pooling: str) -> torch.Tensor:
    """What sentence-transformers computes before its Normalize: the pooled last hidden states."""
    import transformers

    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([token_ids])).last_hidden_state[0]
    return hidden[0] if pooling == "cls" else hidden.mean(dim=0) if pooling == "mean" else hidden[-1]
