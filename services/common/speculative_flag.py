"""A worker's --speculative-config (vLLM's JSON), read into the engine's config: the decode workers' drafts, and the
prefill workers' EAGLE head or MTP layer (whose KV they compute into the pages they hand over)."""
from __future__ import annotations

from engine.speculative import SpeculativeConfig
from services.common.settings import ConfigError, json_object


def speculative_config(given: str | None, source: str) -> SpeculativeConfig | None:
    """--speculative-config's JSON as the engine's config; ConfigError (naming `source`) for one it cannot be."""
    parsed = json_object(given, source)
    if parsed is None:
        return None
    try:
        return SpeculativeConfig.from_dict(parsed)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{source}: {e}") from None
