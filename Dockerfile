# One image for every Baton service; compose.yaml picks the service by its command
# (`python -m services.<name> ...`, the same entry points `baton up` starts locally).
# No model weights are baked in: they live in a volume (compose.yaml's `models`).
#
#   docker build -t baton:latest .                       # CPU torch
#   docker build -t baton:cuda --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
FROM python:3.11-slim

# torch's version is pinned once, in pyproject.toml (torch==2.13.0); this index only
# chooses its build. The CPU index's 2.13.0+cpu satisfies ==2.13.0 and sorts above
# PyPI's 2.13.0, so pip takes it instead of the CUDA wheels PyPI serves on Linux.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# The CPU decode-attention kernel (kernels/cpu/) is compiled on first use with the
# system C compiler (-fopenmp); without one the torch reference runs, slower.
ARG WITH_C_COMPILER=1

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# Debian stable's gcc only moves with security fixes: not pinned.
# hadolint ignore=DL3008
RUN if [ "$WITH_C_COMPILER" = "1" ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi

WORKDIR /app

# Dependencies first, in their own layer, so a source change does not reinstall torch.
COPY pyproject.toml ./
RUN python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" \
        > /tmp/requirements.txt \
    && pip install --extra-index-url "$TORCH_INDEX_URL" -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

COPY . .
RUN pip install --extra-index-url "$TORCH_INDEX_URL" . \
    && rm -rf build ./*.egg-info \
    && python -m compileall -q cli.py engine kernels services protos

# Services run from the source tree in /app (`python -m` puts the working directory
# first on sys.path, and PYTHONPATH does the same for the `baton` script): the wheel
# carries only .py files, not kernels/cpu/*.c that the kernel build reads.
ENV PYTHONPATH=/app

# Non-root. /models is created here, owned by that user, so an empty named volume
# mounted there starts with that ownership and model-init can write into it.
# HOME holds the compiled-kernel cache (~/.cache/baton/kernels).
# The USER is numeric so Kubernetes' runAsNonRoot can verify it.
RUN groupadd --gid 10001 baton \
    && useradd --create-home --uid 10001 --gid baton --shell /usr/sbin/nologin baton \
    && mkdir /models && chown baton:baton /models
USER 10001:10001

# HTTP (gateway), then the gRPC ports: gateway, tokenizer, prefill, decode, kvstore.
EXPOSE 8000 50050 50051 50052 50053 50054

# No ENTRYPOINT: each compose service gives its whole command.
CMD ["baton", "--help"]
