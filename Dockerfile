# syntax=docker/dockerfile:1
#
# Two images from one file:
#   docker build --target operator   -t preshard-operator .
#   docker build --target serializer -t preshard-serializer .
# `operator` runs the controller (`preshard run`) and is also the tools image of the CPU Jobs
# (`preshard verify|delete`) and the `fetch-config` init container: the control-plane
# dependencies plus boto3, no torch. The controller itself never imports boto3.
# `serializer` is vLLM's own image plus preshard's data plane: the Jobs and init containers
# run `preshard serialize|verify|fetch-config|delete` in it, so shards are written by exactly
# the vLLM version that will load them.

FROM python:3.11-slim-bookworm AS operator
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY requirements/dev.txt requirements/tensorizer-bundle.txt requirements/
COPY operator operator
# The lock file pins the control-plane dependencies to the versions the tests ran with.
# The tensorizer bundle is not imported here: `fetch-config --tensorizer-dir` copies it into
# patched vLLM pods, whose stock image has no tensorizer.
RUN pip install --constraint requirements/dev.txt ".[s3]" \
    && pip install --no-deps --target /opt/preshard/tensorizer-bundle \
        -r requirements/tensorizer-bundle.txt \
    && cd / && rm -rf /src
ENV PRESHARD_TENSORIZER_BUNDLE=/opt/preshard/tensorizer-bundle
WORKDIR /
USER 65532:65532
ENTRYPOINT ["preshard"]
CMD ["run"]

FROM vllm/vllm-openai:v0.34.0 AS serializer
# tensorizer streams S3 objects through `curl`; the serving image needs it, and so does this one
# when it loads shards back.
RUN apt-get update \
    && apt-get install -y --no-install-recommends curl ca-certificates \
    && rm -rf /var/lib/apt/lists/*
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1 \
    HOME=/home/preshard
COPY pyproject.toml README.md /src/
COPY operator /src/operator
# vLLM and torch stay exactly as the base image has them (constraints from what is installed);
# vLLM's `tensorizer` extra brings the tensorizer version vLLM pins.
RUN set -eux; \
    vllm_version="$(python3 -c 'from importlib.metadata import version; print(version("vllm"))')"; \
    torch_version="$(python3 -c 'from importlib.metadata import version; print(version("torch"))')"; \
    printf 'vllm==%s\ntorch==%s\n' "$vllm_version" "$torch_version" > /tmp/constraints.txt; \
    python3 -m pip install --constraint /tmp/constraints.txt \
        "vllm[tensorizer]==${vllm_version}" "/src[dataplane]"; \
    test "$(python3 -c 'from importlib.metadata import version; print(version("vllm"))')" = "$vllm_version"; \
    test "$(python3 -c 'from importlib.metadata import version; print(version("torch"))')" = "$torch_version"; \
    rm -rf /src /tmp/constraints.txt; \
    mkdir -p /home/preshard; \
    chown 65532:65532 /home/preshard
WORKDIR /home/preshard
USER 65532:65532
ENTRYPOINT ["preshard"]
CMD ["--help"]
