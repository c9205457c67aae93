"""What each child of `baton up` finds in its environment.

The mesh's settings that travel as variables rather than flags (specs.py names them)
are set; what a child must not inherit from `baton up`'s own environment is removed.
"""
from __future__ import annotations

import os

from services.common.tokenizer_dir_flag import ENV_TOKENIZER_DIR
from services.launcher.specs import (
    API_KEY_VARIABLE,
    CHAT_TEMPLATE_VARIABLE,
    DEVICE_VARIABLE,
    DTYPE_VARIABLE,
    HF_OVERRIDES_VARIABLE,
    LORA_MODULES_VARIABLE,
    MAX_MODEL_LEN_VARIABLE,
    MeshConfig,
)

REDIS_URL_VARIABLE = "BATON_REDIS_URL"  # what the services (and `baton up --redis`) read
OTLP_TRACES_ENDPOINT_VARIABLE = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"


def child_environment(config: MeshConfig, name: str) -> dict[str, str]:
    """The environment of the child called `name`: this process's, with the mesh's settings."""
    # Each child's stdout is a pipe, so unbuffered output keeps its lines prompt. The
    # services are given Redis by --redis alone, never by an inherited variable; the API
    # key goes to the gateway alone, which is what asks for it.
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop(REDIS_URL_VARIABLE, None)
    env.pop(API_KEY_VARIABLE, None)
    if name == "gateway" and config.api_key:
        env[API_KEY_VARIABLE] = config.api_key
    if config.chat_template is not None:
        env[CHAT_TEMPLATE_VARIABLE] = config.chat_template
    if config.tokenizer_dir is not None:
        env[ENV_TOKENIZER_DIR] = config.tokenizer_dir
    if config.dtype is not None:
        env[DTYPE_VARIABLE] = config.dtype
    if config.device is not None:
        env[DEVICE_VARIABLE] = config.device
    if config.max_model_len is not None:
        env[MAX_MODEL_LEN_VARIABLE] = str(config.max_model_len)
    if config.lora_modules is not None:
        env[LORA_MODULES_VARIABLE] = " ".join(config.lora_modules)
    if config.hf_overrides is not None:
        env[HF_OVERRIDES_VARIABLE] = config.hf_overrides
    if config.otlp_traces_endpoint is not None:  # the standard variable, which every service reads (tracing.py)
        env[OTLP_TRACES_ENDPOINT_VARIABLE] = config.otlp_traces_endpoint
    return env
