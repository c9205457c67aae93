"""KV page transport between prefill and decode workers (DESIGN.md, "The KV cache and its transport")."""
