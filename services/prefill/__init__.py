"""The prefill worker: runs prompts (chunked, batched, prefix-cached), samples the first token and
writes the prompt's KV pages into a decode worker's reserved pages."""
