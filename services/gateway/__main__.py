"""`python -m services.gateway --model DIR --tokenizer HOST:PORT (--prefill HOST:PORT[,...] | --colocated)
--decode HOST:PORT[,...] [--host 127.0.0.1] [--port 0] [--http-port 8000]`

Runs through services/common/entrypoint.py: binds the public gRPC API and prints
`gateway listening on HOST:PORT`, then binds the OpenAI HTTP API and prints
`gateway http listening on HOST:PORT` (`https` with --ssl-certfile; the lines `baton up` reads). It loads the
model's tokenizer (to detokenize), connects to every worker and watches their
health; gRPC health turns SERVING, and HTTP `/health` 200, once at least one prefill (none
with --colocated) and one decode worker serve (without a tokenizer service it encodes prompts itself). SIGTERM or
SIGINT: both APIs stop taking requests at once, in-flight ones get the grace period (--shutdown-grace-s),
those still running just before its end are aborted (finish_reason "abort"), exit code 0.
"""
from __future__ import annotations

import asyncio
import importlib.util
import logging
import sys
from collections.abc import Sequence

import services.common.grpc_env  # noqa: F401  (first: before anything imports grpc)

# isort: split

from engine.checkpoint import kv_fingerprint, read_model_config
from engine.classifier_config import is_sequence_classifier
from engine.config import EngineConfig
from engine.encoder_config import is_encoder
from engine.multimodal import takes_images
from protos import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    gateway_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from services.common.entrypoint import StartError, load_in_thread, run_service
from services.common.redis_client import connect_redis
from services.common.registry import InstanceRegistry
from services.common.settings import ConfigError
from services.gateway.api_keys import ApiKeys
from services.gateway.config import GatewayConfig, local_prefill_limit
from services.gateway.grpc_api import SERVICE_NAME, GenerateServicer
from services.gateway.http_app import GatewayState, create_app
from services.gateway.http_listener import HttpListener
from services.gateway.index_mirror import IndexMirror
from services.gateway.kv_capacity import learn_kv_capacity
from services.gateway.lora_updates import LoRAUpdates
from services.gateway.pipeline import RequestPipeline
from services.gateway.random_router import RandomRouter
from services.gateway.reasoning_config import thinking_markers as thinking_markers_of
from services.gateway.request_bytes import stub_taking_bytes
from services.gateway.request_log import RequestLog
from services.gateway.response_store import MemoryResponseStore, RedisResponseStore
from services.gateway.router import PrefixRouter, RouterConfig
from services.gateway.score_api import is_cross_encoder
from services.gateway.served_models import ServedModels
from services.gateway.timeline import TimelineStore
from services.gateway.tokenizer_info import tokenizer_info
from services.gateway.worker_discovery import (
    expand_addresses,
    follow,
    needs_resolving,
    registered_workers,
    resolved_names,
)
from services.gateway.workers import WorkerPool
from services.kvstore.prefix_index import PrefixIndex
from services.tokenizer.image_tokens import QWEN_VIDEOS, TIMED_VIDEOS
from services.tokenizer.model_tokenizer import ModelTokenizer

log = logging.getLogger("baton.gateway")
# Requests still running this long before the end of the shutdown grace are aborted, to end before the
# servers cut them.
ABORT_BEFORE_S = 0.5

# The workers' service names, for their health; from the protos, so the gateway does not
# import the workers' code (and the engine behind it).
HEALTH_SERVICES = {
    "tokenizer": tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name,
    "prefill": prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name,
    "decode": decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name,
}

KV_TRANSPORTS = {
    "auto": common_pb2.KV_TRANSPORT_UNSPECIFIED,
    "shared-memory": common_pb2.KV_TRANSPORT_SHARED_MEMORY,
    "grpc-stream": common_pb2.KV_TRANSPORT_GRPC_STREAM,
    "cuda-ipc": common_pb2.KV_TRANSPORT_CUDA_IPC,
}
READY_POLL_S = 0.05


class GatewayService:
    service_names = [SERVICE_NAME]

    def __init__(self, config: GatewayConfig):
        self.config = config
        self.timelines = TimelineStore()  # both APIs' requests' ledgers, served over HTTP
        self.api_keys = ApiKeys(config.api_keys) if config.api_keys else None
        self.models = ServedModels(config.served_model_names, config.lora_modules)
        self.servicer = GenerateServicer(self.models,
                                         self.timelines, self.api_keys, config.tool_call_parser,
                                         config.reasoning_parser, config.chat_serving)
        self.servicers = [(gateway_pb2_grpc.add_GenerateServicer_to_server, self.servicer)]
        self.pools: dict[str, WorkerPool] = {}
        self.pipeline: RequestPipeline | None = None
        self.router: PrefixRouter | RandomRouter | None = None
        self.http = HttpListener()
        self.followers: list[asyncio.Task] = []  # each pool following where its workers are (worker_discovery.follow)
        self.registry_redis = None  # with --discover-workers: the client its followers ask the registry with
        self.responses = make_response_store(config)
        self.state: GatewayState | None = None  # the HTTP API's, once started
        self.draining: asyncio.Task | None = None  # both APIs' stop, from the signal on (`_drain_on`)
        self._aborting: asyncio.TimerHandle | None = None

    def readiness(self) -> str | None:
        # Without a tokenizer service the gateway encodes prompts itself (prompt_encoder.py).
        missing = [kind for kind, pool in self.pools.items() if pool.num_serving == 0 and kind != "tokenizer"]
        if not self.pools or missing:
            return f"not ready: no {' or '.join(missing) or 'worker'} serving"
        return None

    async def start(self, stop: asyncio.Event) -> str | None:
        config = self.config
        tokenizer = await load_in_thread(stop, ModelTokenizer.from_dir, config.model_dir,
                                         max_model_len=config.max_model_len, chat_template=config.chat_template,
                                         hf_overrides=config.hf_overrides, tokenizer_dir=config.tokenizer_dir)
        if tokenizer is None:
            return None
        limit = config.max_message_bytes
        self.pools = {"tokenizer": WorkerPool.connect(expand_addresses(config.tokenizer_addresses),
                                                      tokenizer_pb2_grpc.TokenizerStub, "tokenizer", limit)}
        if not config.is_colocated:
            self.pools["prefill"] = WorkerPool.connect(
                expand_addresses(config.prefill_addresses),
                stub_taking_bytes(prefill_pb2_grpc.PrefillStub, "baton.prefill.v1.Prefill"), "prefill", limit)
        self.pools["decode"] = WorkerPool.connect(
            expand_addresses(config.decode_addresses),
            stub_taking_bytes(decode_pb2_grpc.DecodeStub, "baton.decode.v1.Decode"), "decode", limit)
        workers = self.metrics.gauge("baton_gateway_workers", "Workers the gateway routes to, by kind: in its pool "
                                     "(known) and of those, the ones whose health check says SERVING (serving)",
                                     ["kind", "state"])
        self.pools["decode"].before_serving(learn_kv_capacity)
        for kind, pool in self.pools.items():
            pool.watch_health(HEALTH_SERVICES[kind])
            workers.labels(**self.metrics.labels, kind=kind, state="known").set_function(lambda p=pool: len(p.workers))
            workers.labels(**self.metrics.labels, kind=kind, state="serving").set_function(lambda p=pool: p.num_serving)
        self._follow_workers()
        prefill = self.pools.get("prefill")
        self.router = make_router(config, prefill, self.pools["decode"]) if prefill is not None else None
        try:
            thinking_markers = thinking_markers_of(config.reasoning_config, config.reasoning_parser, tokenizer)
        except ConfigError as e:  # the tokenizer's say: known only now
            raise StartError(str(e)) from None
        request_log = RequestLog(config.log_requests_level, config.max_log_len,
                                 decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
        # Colocated there is no prefill pool: every prompt goes to the decode worker.
        self.pipeline = RequestPipeline(self.pools["tokenizer"], tokenizer, prefill,
                                        self.pools["decode"], kv_transport=KV_TRANSPORTS[config.kv_transport],
                                        prefill_router=self.router,
                                        local_prefill_max_tokens=local_prefill_limit(
                                            config.local_prefill_max_tokens, tokenizer.max_model_len),
                                        local_tokenize_max_chars=config.local_tokenize_max_chars,
                                        preopen_prefill_calls=config.prefill_calls == "preopened",
                                        metrics=self.metrics, max_num_requests=config.max_num_requests,
                                        stream_interval=config.stream_interval,
                                        trust_request_chat_template=config.trust_request_chat_template,
                                        generation_defaults=config.generation_defaults,
                                        request_log=request_log,
                                        default_chat_template_kwargs=config.default_chat_template_kwargs,
                                        chat_content_format=config.chat_template_content_format,
                                        thinking_markers=thinking_markers, max_logprobs=config.max_logprobs)
        if config.default_chat_template_kwargs:
            log.info("chat template variables for what requests' chat_template_kwargs leave out: %s",
                     config.default_chat_template_kwargs)
        if config.generation_defaults:
            log.info("sampling defaults for what requests leave out, as the model's generation config recommends "
                     "(--generation-config vllm for none): %s", config.generation_defaults.describe())
        self.servicer.pipeline = self.pipeline

        token_text = lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)  # noqa: E731
        self.models.max_model_len = tokenizer.max_model_len
        model_json = read_model_config(config.model_dir, config.hf_overrides)
        self.models.is_cross_encoder = is_cross_encoder(model_json)
        self.models.has_classifier = is_sequence_classifier(model_json)
        self.models.generates_text = not is_encoder(model_json)
        self.state = GatewayState(self.pipeline, self.models, token_text,
                                  self.readiness, config.max_body_bytes, self.timelines, self.api_keys,
                                  config.tool_call_parser, config.reasoning_parser, self.responses,
                                  serving=config.http_serving, chat_serving=config.chat_serving,
                                  replies=config.reply_options, sleep_when_idle=config.sleep_when_idle)
        if config.allow_runtime_lora_updating:
            worker_pools = [pool for kind, pool in self.pools.items() if kind != "tokenizer"]
            self.state.lora_updates = LoRAUpdates(self.models, worker_pools)
        if isinstance(self.responses, RedisResponseStore):  # a cancel may come through another gateway
            self.state.background.follow_cancels(self.responses)
        # PIL and numpy, only where images are read (with a limit of 0, only as their encoder's rows)
        if takes_images(model_json) and (config.limit_images != 0 or config.enable_mm_embeds):
            from services.gateway.image_cache import ProcessedImageCache
            from services.gateway.image_inputs import MESSAGE_HEADROOM_BYTES, ChatImages
            from services.gateway.image_processing import ImageProcessing
            cache_bytes = int(config.mm_processor_cache_gb * 2**30)
            processing = ImageProcessing.from_dir(config.model_dir, config.mm_processor_kwargs).with_media_io(
                config.media_io_kwargs)
            self.state.images = self.servicer.images = ChatImages(
                processing, config.allowed_local_media_path, config.allowed_media_domains, config.limit_images,
                ProcessedImageCache(cache_bytes) if cache_bytes else None,
                max_bytes=max(config.max_message_bytes - MESSAGE_HEADROOM_BYTES, 0),
                embeds=self._image_embeds(config, processing) if config.enable_mm_embeds else None,
                videos=self._videos(config, model_json), video_limit=config.limit_videos)
        if config.enable_prompt_embeds:
            # torch, only where they are taken
            from engine.model_config_loader import load_model_config
            from services.gateway.prompt_embeds import PromptEmbedsReader
            model = load_model_config(config.model_dir, config.hf_overrides)
            self.state.prompt_embeds = PromptEmbedsReader(model.hidden_size)
            self.servicer.takes_prompt_embeds = True
        if config.enable_tokenizer_info_endpoint:
            self.state.tokenizer_info = tokenizer_info(config.tokenizer_dir or config.model_dir,
                                                       tokenizer.chat_templates)
        app = create_app(self.state)
        if self.state.idle_sleep is not None:
            self.state.idle_sleep.start()
        port = self.http.start(app, config.host, config.http_port, config.http_serving, config.grace_s)
        print(f"gateway {config.http_serving.scheme} listening on {config.host}:{port}", flush=True)
        self.draining = asyncio.ensure_future(self._drain_on(stop))

        while self.readiness() is not None:
            if stop.is_set():
                return None
            await asyncio.sleep(READY_POLL_S)
        counts = {kind: len(pool.workers) for kind, pool in self.pools.items()}
        keyed = f", {len(config.api_keys)} API key(s) asked for" if config.api_keys else ""
        if config.is_colocated:
            return (f"serving {config.served_model_name} colocated: {counts['decode']} decode workers prefill "
                    f"every prompt themselves{keyed}")
        routing = {PrefixRouter: f"prefix-aware routing (index at {config.redis_url})",
                   RandomRouter: "random routing"}.get(type(self.router), "load-only routing")
        return (f"serving {config.served_model_name}: {counts['prefill']} prefill and {counts['decode']} decode "
                f"workers, KV transport {config.kv_transport}, {routing}, decode prefills prompts of up to "
                f"{self.pipeline.local_prefill_max_tokens} tokens itself{keyed}")

    @staticmethod
    def _image_embeds(config: GatewayConfig, processing):
        """What reads chat's image_embeds parts (torch, only where they are taken), rows of the text model's width
        (Qwen3-VL's once more for each DeepStack layer: vLLM takes its rows with theirs beside them)."""
        from engine.model_config_loader import load_model_config
        from services.gateway.image_embeds import ImageEmbedsReader
        from services.gateway.prompt_embeds import PromptEmbedsReader
        model = load_model_config(config.model_dir, config.hf_overrides)
        if model.vision is None or not model.vision.deepstack_layers:
            return ImageEmbedsReader(processing, PromptEmbedsReader(model.hidden_size))
        width = model.hidden_size * (1 + len(model.vision.deepstack_layers))
        return ImageEmbedsReader(processing, PromptEmbedsReader(
            width, "the model's hidden size for its rows, then for each DeepStack layer's"))

    @staticmethod
    def _videos(config: GatewayConfig, model_json: dict):
        """What reads chat's videos, for a model whose videos are served and not limited to 0; else None."""
        if config.limit_videos == 0 or model_json.get("model_type") not in QWEN_VIDEOS:
            return None
        if importlib.util.find_spec("torch") is None:  # the Dockerfile's light image: frames are resized by torch
            log.warning("videos are not served: this gateway has no torch to resize their frames with")
            return None
        from services.gateway.video_processing import VideoProcessing
        return VideoProcessing.from_dir(config.model_dir, config.media_io_kwargs.get("video"),
                                        model_json["model_type"] in TIMED_VIDEOS
                                        ).with_request_kwargs(config.mm_processor_kwargs)

    def _follow_workers(self) -> None:
        """Keep the pools on their names as they resolve now, and with --discover-workers the prefill
        and decode pools on the workers of this model in the instance registry."""
        config = self.config
        if not config.resolve_workers_s > 0:
            return
        names = {"prefill": config.prefill_addresses, "decode": config.decode_addresses,
                 "tokenizer": config.tokenizer_addresses}
        if config.discover_workers:
            self.registry_redis = connect_redis(config.redis_url)
            registry = InstanceRegistry(self.registry_redis)
            model_key = kv_fingerprint(config.model_dir, config.max_model_len, config.hf_overrides).hex()
        for kind, pool in self.pools.items():
            sources = [resolved_names(names[kind])] if names[kind] else []
            is_registered = config.discover_workers and kind != "tokenizer"  # tokenizers do not register
            if is_registered:
                sources.append(registered_workers(registry, kind, model_key))
            if is_registered or needs_resolving(names[kind]):
                self.followers.append(asyncio.ensure_future(follow(pool, sources, config.resolve_workers_s)))

    async def _drain_on(self, stop: asyncio.Event) -> None:
        """From the signal on, the HTTP API takes no request, as the gRPC one (the entry point stops it
        meanwhile); both give those in flight the grace, and the ones still running ABORT_BEFORE_S before
        its end are aborted: they end as vLLM's do (finish_reason "abort", a stream's last chunk and
        [DONE], their usage), not cut by the servers (a 500, a stream broken off, a CANCELLED call)."""
        await stop.wait()
        self._aborting = asyncio.get_running_loop().call_later(max(0.0, self.config.grace_s - ABORT_BEFORE_S),
                                                               self._abort_running)
        await self.http.stop()

    def _abort_running(self) -> None:
        if self.pipeline is not None and (aborted := self.pipeline.running.abort_all()):
            log.warning("aborting %d requests still running at the end of the shutdown grace", len(aborted))

    async def close(self) -> None:
        for follower in self.followers:
            follower.cancel()
        await asyncio.gather(*self.followers, return_exceptions=True)
        if self.registry_redis is not None:
            await self.registry_redis.aclose()
        await self.http.stop()  # the drain's, under way since the signal (now, after a start that failed)
        if self.draining is not None:
            self.draining.cancel()  # done with it, or waiting for a signal that is not coming
            await asyncio.gather(self.draining, return_exceptions=True)
        if self._aborting is not None:
            self._aborting.cancel()
        if self.state is not None:
            await self.state.background.close()
            await self.state.batches.close()
            if self.state.idle_sleep is not None:
                await self.state.idle_sleep.aclose()
        if self.pipeline is not None:
            await self.pipeline.aclose()
        if self.router is not None:
            await self.router.close()
        if self.responses is not None:
            await self.responses.close()
        for pool in self.pools.values():
            await pool.close()


def make_response_store(config: GatewayConfig) -> MemoryResponseStore | RedisResponseStore | None:
    """Where the Responses API keeps responses: Redis when there is one, shared by every gateway
    (a conversation may go on through any of them); else this process."""
    if not config.responses_ttl_s > 0:
        return None
    if config.redis_url:
        return RedisResponseStore(connect_redis(config.redis_url), config.responses_ttl_s)
    return MemoryResponseStore(config.responses_ttl_s)


def make_router(config: GatewayConfig, prefill: WorkerPool, decode: WorkerPool) -> PrefixRouter | RandomRouter | None:
    """The router `--routing` names, started; None for load only (the pool's own choice),
    which is also what prefix routing is without --redis. `decode`: the pool whose workers' room it keeps."""
    if config.routing == "random":
        return RandomRouter(prefill)
    if config.routing == "load" or not config.redis_url:
        return None
    client = connect_redis(config.redis_url)
    model_dir = config.model_dir
    fingerprint = kv_fingerprint(model_dir, config.max_model_len, config.hf_overrides)
    index = PrefixIndex(client, fingerprint.hex())
    router = PrefixRouter(prefill, index, InstanceRegistry(client), fingerprint=fingerprint,
                          block_size=EngineConfig.block_size, config=RouterConfig(overlap_weight=config.overlap_weight),
                          redis=client, mirror=IndexMirror(client, index), decode=decode)
    router.start()
    return router


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("gateway", GatewayConfig.from_args, GatewayService, argv)


if __name__ == "__main__":
    sys.exit(main())
