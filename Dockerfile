# syntax=docker/dockerfile:1
# One image, three commands: smg-router (the default command), smg-operator and smg-sim.
#   docker build -t smg:0.1.0 .
#   docker run --rm -p 30000:30000 smg:0.1.0 smg-router --host 0.0.0.0 --worker-urls http://10.0.0.5:8000
#   docker run --rm smg:0.1.0 smg-sim --host 0.0.0.0 --port 8000 --model sim-model
ARG PYTHON_IMAGE=python:3.11-slim

# --- builder: the project's wheel (/dist) and the wheels of its dependencies (/wheels) ---------------------
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY router ./router
COPY sim ./sim
COPY operator ./operator
RUN pip wheel --no-deps --wheel-dir /dist . \
 && pip wheel --wheel-dir /wheels /dist/*.whl

# --- runtime: python:3.11-slim and the installed wheels; no compiler, no sources, no pip cache ------------
FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN --mount=type=bind,from=builder,source=/dist,target=/dist \
    --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels /dist/*.whl \
 && groupadd --system --gid 10001 smg \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin smg
LABEL org.opencontainers.image.title="smg" \
      org.opencontainers.image.description="SMG: a Kubernetes-native, cache-aware router for LLM inference fleets" \
      org.opencontainers.image.licenses="Apache-2.0"
USER 10001:10001
EXPOSE 30000
CMD ["smg-router"]
