from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
    FINISH_REASON_TOOL_CALLS: _ClassVar[FinishReason]

class KVTransport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TRANSPORT_UNSPECIFIED: _ClassVar[KVTransport]
    KV_TRANSPORT_SHARED_MEMORY: _ClassVar[KVTransport]
    KV_TRANSPORT_GRPC_STREAM: _ClassVar[KVTransport]
    KV_TRANSPORT_CUDA_IPC: _ClassVar[KVTransport]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
FINISH_REASON_TOOL_CALLS: FinishReason
KV_TRANSPORT_UNSPECIFIED: KVTransport
KV_TRANSPORT_SHARED_MEMORY: KVTransport
KV_TRANSPORT_GRPC_STREAM: KVTransport
KV_TRANSPORT_CUDA_IPC: KVTransport

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop_token_ids", "ignore_eos", "logprobs", "logit_bias", "min_tokens", "prompt_logprobs", "allowed_token_ids", "guided_regex", "guided_grammar", "guide_after_token_id", "guide_after_token_ids", "priority", "bad_words", "lora_name", "stream_interval", "cache_salt", "logprob_token_ids", "thinking_budget", "prompt_embeds", "images")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GUIDED_REGEX_FIELD_NUMBER: _ClassVar[int]
    GUIDED_GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    GUIDE_AFTER_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    GUIDE_AFTER_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    THINKING_BUDGET_FIELD_NUMBER: _ClassVar[int]
    PROMPT_EMBEDS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    prompt_logprobs: int
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    guided_regex: str
    guided_grammar: str
    guide_after_token_id: int
    guide_after_token_ids: _containers.RepeatedScalarFieldContainer[int]
    priority: int
    bad_words: _containers.RepeatedCompositeFieldContainer[TokenIds]
    lora_name: str
    stream_interval: int
    cache_salt: str
    logprob_token_ids: _containers.RepeatedScalarFieldContainer[int]
    thinking_budget: ThinkingBudget
    prompt_embeds: PromptEmbeds
    images: _containers.RepeatedCompositeFieldContainer[PromptImage]
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., guided_regex: _Optional[str] = ..., guided_grammar: _Optional[str] = ..., guide_after_token_id: _Optional[int] = ..., guide_after_token_ids: _Optional[_Iterable[int]] = ..., priority: _Optional[int] = ..., bad_words: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., lora_name: _Optional[str] = ..., stream_interval: _Optional[int] = ..., cache_salt: _Optional[str] = ..., logprob_token_ids: _Optional[_Iterable[int]] = ..., thinking_budget: _Optional[_Union[ThinkingBudget, _Mapping]] = ..., prompt_embeds: _Optional[_Union[PromptEmbeds, _Mapping]] = ..., images: _Optional[_Iterable[_Union[PromptImage, _Mapping]]] = ...) -> None: ...

class PromptImage(_message.Message):
    __slots__ = ("rgb", "channels", "height", "width", "rescale_factor", "mean", "std", "digest", "crop", "embeds", "frames", "fps")
    RGB_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    RESCALE_FACTOR_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    STD_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    CROP_FIELD_NUMBER: _ClassVar[int]
    EMBEDS_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    rgb: bytes
    channels: int
    height: int
    width: int
    rescale_factor: float
    mean: _containers.RepeatedScalarFieldContainer[float]
    std: _containers.RepeatedScalarFieldContainer[float]
    digest: str
    crop: bool
    embeds: PromptEmbeds
    frames: int
    fps: float
    def __init__(self, rgb: _Optional[bytes] = ..., channels: _Optional[int] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., rescale_factor: _Optional[float] = ..., mean: _Optional[_Iterable[float]] = ..., std: _Optional[_Iterable[float]] = ..., digest: _Optional[str] = ..., crop: _Optional[bool] = ..., embeds: _Optional[_Union[PromptEmbeds, _Mapping]] = ..., frames: _Optional[int] = ..., fps: _Optional[float] = ...) -> None: ...

class PromptEmbeds(_message.Message):
    __slots__ = ("data", "num_rows", "hidden_size", "dtype", "digest")
    DATA_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    num_rows: int
    hidden_size: int
    dtype: str
    digest: str
    def __init__(self, data: _Optional[bytes] = ..., num_rows: _Optional[int] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[str] = ..., digest: _Optional[str] = ...) -> None: ...

class ThinkingBudget(_message.Message):
    __slots__ = ("max_tokens", "start_token_ids", "end_token_ids", "forced_end_token_ids")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    START_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    END_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FORCED_END_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    start_token_ids: _containers.RepeatedScalarFieldContainer[int]
    end_token_ids: _containers.RepeatedScalarFieldContainer[int]
    forced_end_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, max_tokens: _Optional[int] = ..., start_token_ids: _Optional[_Iterable[int]] = ..., end_token_ids: _Optional[_Iterable[int]] = ..., forced_end_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "reasoning_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASONING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reasoning_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., reasoning_tokens: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("sampled", "top", "requested")
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_FIELD_NUMBER: _ClassVar[int]
    sampled: TokenLogprob
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    requested: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, sampled: _Optional[_Union[TokenLogprob, _Mapping]] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., requested: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype", "model_fingerprint")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    model_fingerprint: bytes
    def __init__(self, num_layers: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., model_fingerprint: _Optional[bytes] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls_json", "tool_call_id", "name", "reasoning_content", "content_parts", "image_parts", "image_urls", "image_embeds", "video_parts", "video_urls", "image_uuids", "video_uuids")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_PARTS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_PARTS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_URLS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_EMBEDS_FIELD_NUMBER: _ClassVar[int]
    VIDEO_PARTS_FIELD_NUMBER: _ClassVar[int]
    VIDEO_URLS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_UUIDS_FIELD_NUMBER: _ClassVar[int]
    VIDEO_UUIDS_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls_json: str
    tool_call_id: str
    name: str
    reasoning_content: str
    content_parts: _containers.RepeatedScalarFieldContainer[str]
    image_parts: _containers.RepeatedScalarFieldContainer[int]
    image_urls: _containers.RepeatedScalarFieldContainer[str]
    image_embeds: _containers.RepeatedCompositeFieldContainer[ChatImageEmbeds]
    video_parts: _containers.RepeatedScalarFieldContainer[int]
    video_urls: _containers.RepeatedScalarFieldContainer[str]
    image_uuids: _containers.RepeatedScalarFieldContainer[str]
    video_uuids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls_json: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ..., reasoning_content: _Optional[str] = ..., content_parts: _Optional[_Iterable[str]] = ..., image_parts: _Optional[_Iterable[int]] = ..., image_urls: _Optional[_Iterable[str]] = ..., image_embeds: _Optional[_Iterable[_Union[ChatImageEmbeds, _Mapping]]] = ..., video_parts: _Optional[_Iterable[int]] = ..., video_urls: _Optional[_Iterable[str]] = ..., image_uuids: _Optional[_Iterable[str]] = ..., video_uuids: _Optional[_Iterable[str]] = ...) -> None: ...

class ChatImageEmbeds(_message.Message):
    __slots__ = ("index", "rows", "image_grid_thw", "uuid")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_GRID_THW_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    index: int
    rows: PromptEmbeds
    image_grid_thw: _containers.RepeatedScalarFieldContainer[int]
    uuid: str
    def __init__(self, index: _Optional[int] = ..., rows: _Optional[_Union[PromptEmbeds, _Mapping]] = ..., image_grid_thw: _Optional[_Iterable[int]] = ..., uuid: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message", "type", "param")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    PARAM_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    type: str
    param: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., type: _Optional[str] = ..., param: _Optional[str] = ...) -> None: ...
