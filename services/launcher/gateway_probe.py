"""How `baton up` tells that its gateway serves HTTP, and which model it names there.

The workers are ready once grpc.health.v1 says SERVING (process.py); the gateway is
also the OpenAI HTTP API, so the launcher polls its GET /health until 200, then reads
the model's name from GET /v1/models for the banner.
"""
from __future__ import annotations

import asyncio
import json
import ssl
import urllib.request

from services.launcher.process import probe_address

# The gateway is on this host: an http_proxy variable must not reroute the probe.
# The gateway's own certificate may be one no CA signed: the launcher probes its own child on
# loopback, and reads only /health and the model's name, so it does not check it.
_NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                               urllib.request.HTTPSHandler(context=ssl._create_unverified_context()))


async def http_model_name(scheme: str, address: str, api_key: str | None = None) -> str | None:
    """Polls GET /health until 200, then reads the first id of GET /v1/models (None if it has none)."""
    base = f"{scheme}://{probe_address(address)}"
    while await asyncio.to_thread(_http_get, f"{base}/health") is None:
        await asyncio.sleep(0.1)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        models = json.loads(await asyncio.to_thread(_http_get, f"{base}/v1/models", headers) or "{}").get("data") or []
        return str(models[0]["id"]) if models else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _http_get(url: str, headers: dict[str, str] | None = None) -> bytes | None:
    """The body of a 200 answer to GET `url`, else None."""
    try:
        with _NO_PROXY_OPENER.open(urllib.request.Request(url, headers=headers or {}), timeout=2.0) as response:
            return response.read() if response.status == 200 else None
    except OSError:
        return None
