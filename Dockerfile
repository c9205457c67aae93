# Two images from one source tree; compose.yaml picks the service by its command
# (`python -m services.<name> ...`, the same entry points `baton up` starts locally):
# - `full` (the default target): every service, torch included, for the prefill and decode
#   workers, the kvstore node and `baton` itself;
# - `light`: the gateway and the tokenizer service, which compute no tensor: pyproject's
#   dependencies without its `engine` extra (torch and what only the workers read), so a
#   gateway replica pulls and starts without torch (tests/services/test_light_services.py).
# No model weights are baked in: they live in a volume (compose.yaml's `models`).
#
#   docker build -t baton:latest .                       # CPU torch
#   docker build -t baton:cuda --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#   docker build -t baton-light:latest --target light .
FROM python:3.11-slim AS base

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# Non-root. /models (and /var/cache/baton-kv, a kvstore node's disk tier) is created here, owned by
# that user, so an empty named volume mounted there starts with that ownership and can be written.
# HOME holds the compiled-kernel cache (~/.cache/baton/kernels).
# The USER (set in each image) is numeric so Kubernetes' runAsNonRoot can verify it.
RUN groupadd --gid 10001 baton \
    && useradd --create-home --uid 10001 --gid baton --shell /usr/sbin/nologin baton \
    && mkdir /models /var/cache/baton-kv && chown baton:baton /models /var/cache/baton-kv

WORKDIR /app
# Dependencies first, in their own layer, so a source change does not reinstall them.
COPY pyproject.toml ./

FROM base AS light

RUN python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

COPY . .
RUN pip install --no-deps . \
    && rm -rf build ./*.egg-info \
    && python -m compileall -q cli.py engine services protos

# Services run from the source tree in /app (`python -m` puts the working directory first on sys.path).
ENV PYTHONPATH=/app
USER 10001:10001
# HTTP (gateway), then the gRPC ports: gateway, tokenizer.
EXPOSE 8000 50050 50051
CMD ["python", "-m", "services.gateway", "--help"]

FROM base AS full

# torch's version is pinned once, in pyproject.toml (torch==2.13.0); this index only
# chooses its build. The CPU index's 2.13.0+cpu satisfies ==2.13.0 and sorts above
# PyPI's 2.13.0, so pip takes it instead of the CUDA wheels PyPI serves on Linux.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# The CPU decode-attention kernel (kernels/cpu/) is compiled on first use with the
# system C compiler (-fopenmp); without one the torch reference runs, slower.
ARG WITH_C_COMPILER=1

# Debian stable's gcc only moves with security fixes: not pinned.
# hadolint ignore=DL3008
RUN if [ "$WITH_C_COMPILER" = "1" ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi

RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print(*p['dependencies'], *p['optional-dependencies']['engine'], sep='\n')" \
        > /tmp/requirements.txt \
    && pip install --extra-index-url "$TORCH_INDEX_URL" -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

COPY . .
RUN pip install --extra-index-url "$TORCH_INDEX_URL" ".[engine]" \
    && rm -rf build ./*.egg-info \
    && python -m compileall -q cli.py engine kernels services protos

# Services run from the source tree in /app (`python -m` puts the working directory
# first on sys.path, and PYTHONPATH does the same for the `baton` script): the wheel
# carries only .py files, not kernels/cpu/*.c that the kernel build reads.
ENV PYTHONPATH=/app
USER 10001:10001

# HTTP (gateway), then the gRPC ports: gateway, tokenizer, prefill, decode, kvstore.
EXPOSE 8000 50050 50051 50052 50053 50054

# No ENTRYPOINT: each compose service gives its whole command.
CMD ["baton", "--help"]
