"""vLLM's per-request histograms of a request's sequences (`request_params_n`,
`request_max_num_generation_tokens`), counted as the choices of a response go by: vLLM's request is
one prompt, whose sequences are its `n` choices (or `best_of` candidates), so each prompt of a
response is counted once all its sequences have ended, by how many there were and the most tokens
any one generated. A response that fails or is abandoned counts none of its prompts that had not
ended."""
from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing

from services.common.metrics import RequestMetrics
from services.gateway.deltas import Delta


async def counted_by_prompt(choices: AsyncIterator[tuple[int, Delta]], prompt_of_choice: Sequence[int],
                            metrics: RequestMetrics) -> AsyncIterator[tuple[int, Delta]]:
    """`choices` as they come (choices.py); `prompt_of_choice[i]`: the prompt choice i answers."""
    num_sequences = Counter(prompt_of_choice)
    num_left = dict(num_sequences)
    most_tokens = dict.fromkeys(num_sequences, 0)
    async with aclosing(choices) as deltas:
        async for index, delta in deltas:
            if delta.finish_reason is not None:
                prompt = prompt_of_choice[index]
                if delta.usage is not None:
                    most_tokens[prompt] = max(most_tokens[prompt], delta.usage.completion_tokens)
                num_left[prompt] -= 1
                if num_left[prompt] == 0:
                    metrics.observe_sequence_group(num_sequences[prompt], most_tokens[prompt])
            yield index, delta
