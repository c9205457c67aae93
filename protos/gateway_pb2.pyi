from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StreamOptions(_message.Message):
    __slots__ = ("stream",)
    STREAM_FIELD_NUMBER: _ClassVar[int]
    stream: bool
    def __init__(self, stream: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "text", "chat", "token_ids", "prompt_embeds", "sampling", "stop", "stream_options", "include_stop_str_in_output", "skip_special_tokens", "chat_options", "tools_json", "tool_choice_json", "n", "beam_search", "stop_regex")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_EMBEDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STREAM_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHAT_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_JSON_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    BEAM_SEARCH_FIELD_NUMBER: _ClassVar[int]
    STOP_REGEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    text: str
    chat: _common_pb2.ChatMessages
    token_ids: _common_pb2.TokenIds
    prompt_embeds: _common_pb2.PromptEmbeds
    sampling: _common_pb2.SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    stream_options: StreamOptions
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    chat_options: ChatOptions
    tools_json: str
    tool_choice_json: str
    n: int
    beam_search: BeamSearch
    stop_regex: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[_common_pb2.ChatMessages, _Mapping]] = ..., token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., prompt_embeds: _Optional[_Union[_common_pb2.PromptEmbeds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., stream_options: _Optional[_Union[StreamOptions, _Mapping]] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., chat_options: _Optional[_Union[ChatOptions, _Mapping]] = ..., tools_json: _Optional[str] = ..., tool_choice_json: _Optional[str] = ..., n: _Optional[int] = ..., beam_search: _Optional[_Union[BeamSearch, _Mapping]] = ..., stop_regex: _Optional[_Iterable[str]] = ...) -> None: ...

class BeamSearch(_message.Message):
    __slots__ = ("length_penalty",)
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    length_penalty: float
    def __init__(self, length_penalty: _Optional[float] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("index", "id", "name", "arguments")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    id: str
    name: str
    arguments: str
    def __init__(self, index: _Optional[int] = ..., id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ChatOptions(_message.Message):
    __slots__ = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs_json", "chat_template", "documents_json", "add_special_tokens", "mm_processor_kwargs_json", "media_io_kwargs_json")
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MM_PROCESSOR_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    MEDIA_IO_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template_kwargs_json: str
    chat_template: str
    documents_json: str
    add_special_tokens: bool
    mm_processor_kwargs_json: str
    media_io_kwargs_json: str
    def __init__(self, add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ..., chat_template_kwargs_json: _Optional[str] = ..., chat_template: _Optional[str] = ..., documents_json: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ..., mm_processor_kwargs_json: _Optional[str] = ..., media_io_kwargs_json: _Optional[str] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("text", "token_ids", "logprobs", "prompt_logprobs", "reasoning", "tool_calls", "index")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    reasoning: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    index: int
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., reasoning: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...

class GenerateComplete(_message.Message):
    __slots__ = ("finish_reason", "usage", "matched_stop", "text", "token_ids", "logprobs", "prompt_logprobs", "reasoning", "tool_calls", "index", "metrics")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    matched_stop: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    reasoning: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    index: int
    metrics: RequestMetrics
    def __init__(self, finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., matched_stop: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., reasoning: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., index: _Optional[int] = ..., metrics: _Optional[_Union[RequestMetrics, _Mapping]] = ...) -> None: ...

class RequestMetrics(_message.Message):
    __slots__ = ("time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms", "tokens_per_second")
    TIME_TO_FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ITL_MS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    time_to_first_token_ms: float
    generation_time_ms: float
    queue_time_ms: float
    mean_itl_ms: float
    tokens_per_second: float
    def __init__(self, time_to_first_token_ms: _Optional[float] = ..., generation_time_ms: _Optional[float] = ..., queue_time_ms: _Optional[float] = ..., mean_itl_ms: _Optional[float] = ..., tokens_per_second: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "chunk", "complete", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: GenerateChunk
    complete: GenerateComplete
    error: _common_pb2.Error
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[GenerateChunk, _Mapping]] = ..., complete: _Optional[_Union[GenerateComplete, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("request_id", "model", "texts", "token_ids", "dimensions", "normalize", "truncate_prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    texts: _containers.RepeatedScalarFieldContainer[str]
    token_ids: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenIds]
    dimensions: int
    normalize: bool
    truncate_prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., texts: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Iterable[_Union[_common_pb2.TokenIds, _Mapping]]] = ..., dimensions: _Optional[int] = ..., normalize: _Optional[bool] = ..., truncate_prompt_tokens: _Optional[int] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class Embeddings(_message.Message):
    __slots__ = ("data", "prompt_tokens")
    DATA_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    data: _containers.RepeatedCompositeFieldContainer[Embedding]
    prompt_tokens: int
    def __init__(self, data: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("request_id", "embeddings", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    embeddings: Embeddings
    error: _common_pb2.Error
    def __init__(self, request_id: _Optional[str] = ..., embeddings: _Optional[_Union[Embeddings, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ...) -> None: ...
