"""`python -m services.tokenizer --model DIR [--host 127.0.0.1] [--port 0] [--metrics-port 0]`

Runs through services/common/entrypoint.py: binds and prints `tokenizer listening
on HOST:PORT` and `tokenizer metrics on HOST:PORT` (Prometheus' /metrics), then
loads the tokenizer while health reports NOT_SERVING, then SERVING. SIGTERM or
SIGINT: NOT_SERVING, a grace period, exit code 0. A bad setting, an address that
cannot be bound or an unloadable model exits 2 with one line on stderr.
"""
from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

import services.common.grpc_env  # noqa: F401  (first: before anything imports grpc)
from protos import tokenizer_pb2_grpc
from services.common.entrypoint import load_in_thread, run_service
from services.common.metrics import ServiceMetrics
from services.tokenizer.config import TokenizerServiceConfig
from services.tokenizer.model_tokenizer import ModelTokenizer
from services.tokenizer.servicer import SERVICE_NAME, TokenizerServicer


class TokenizerService:
    """The tokenizer servicer, and the model tokenizer it serves once loaded."""

    service_names = [SERVICE_NAME]

    def __init__(self, config: TokenizerServiceConfig):
        self.config = config
        self.servicer = TokenizerServicer()
        self.servicers = [(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, self.servicer)]
        self.metrics = ServiceMetrics("tokenizer")  # the entry point's, labelled and served, replaces it

    async def start(self, stop: asyncio.Event) -> str | None:
        tokenizer = await load_in_thread(stop, ModelTokenizer.from_dir, self.config.model_dir,
                                         max_model_len=self.config.max_model_len,
                                         chat_template=self.config.chat_template,
                                         hf_overrides=self.config.hf_overrides, tokenizer_dir=self.config.tokenizer_dir)
        if tokenizer is None:
            return None
        self.servicer.metrics = self.metrics
        self.servicer.tokenizer = tokenizer
        return f"serving {self.config.model_dir} (context {tokenizer.max_model_len} tokens)"

    async def close(self) -> None:
        pass


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("tokenizer", TokenizerServiceConfig.from_args, TokenizerService, argv)


if __name__ == "__main__":
    sys.exit(main())
