"""A prompt given as embeddings on its way to the workers: its rows in the request's SamplingParams
(common.proto's PromptEmbeds, which every worker it reaches reads), and its cache salt naming them.
(Reading them from a request is prompt_embeds.py's, in a gateway that serves them.)"""
from __future__ import annotations

from engine.block_hash import embeddings_digest, salted_with_embeddings
from protos import common_pb2

PLACEHOLDER_TOKEN_ID = 0  # each row's token, as vLLM's: what routes, counts and fills the context

def with_prompt_embeds(params: common_pb2.SamplingParams, embeds: common_pb2.PromptEmbeds, num_rows: int) -> None:
    """`params` carrying the last `num_rows` rows of `embeds` (all of them, or as truncate_prompt_tokens
    keeps), and salted with them: the router's hashes and the workers' caches then tell prompts given
    as embeddings apart, their placeholder tokens being all alike."""
    kept = common_pb2.PromptEmbeds(num_rows=num_rows, hidden_size=embeds.hidden_size, dtype=embeds.dtype)
    row_bytes = len(embeds.data) // embeds.num_rows
    kept.data = embeds.data[-num_rows * row_bytes:] if num_rows < embeds.num_rows else embeds.data
    params.prompt_embeds.CopyFrom(kept)
    digest = embeddings_digest(kept.dtype, (kept.num_rows, kept.hidden_size), kept.data)
    params.cache_salt = salted_with_embeddings(params.cache_salt if params.HasField("cache_salt") else None, digest)
