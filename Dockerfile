# One image, three commands: smg-router (the default command), smg-operator and smg-sim.
#   docker build -t smg:0.1.0 .
#   docker build --build-arg BASE_IMAGE=smg-base:bookworm -t smg:0.1.0 .   # scripts/build-base-image.sh
#   docker run --rm -p 30000:30000 smg:0.1.0 smg-router --host 0.0.0.0 --worker-urls http://10.0.0.5:8000
#   docker run --rm smg:0.1.0 smg-sim --host 0.0.0.0 --port 8000 --model sim-model
#
# No `# syntax=` line: it would make BuildKit fetch a frontend image from a registry; the builder's own
# frontend parses this file, and the legacy builder does too.
#
# Offline builds: put SMG's wheel and every dependency's wheel into ./wheelhouse/ of the build context
# (e2e/cluster/ does: `pip wheel --no-deps` + `pip download` on the host) and build with
# `--network none`; without ./wheelhouse/ pip reads the index.
#
# Runs under any uid (OpenShift's arbitrary uids included): nothing needs a passwd entry, every file is
# world-readable, HOME is /tmp (an emptyDir in the chart), and the root filesystem may be read-only (the
# bytecode is compiled at build time, nothing is written outside /tmp).
ARG BASE_IMAGE=python:3.11-slim

# --- builder: a virtual environment in /opt/smg with SMG and its dependencies ------------------------------
# /opt/smg/tokenizers/smg-sim is smg-sim's tokenizer (tokenizer.json, tokenizer_config.json) at a path that does
# not name the Python version: the chart's routers load it to match the sims' KV events on token ids.
FROM ${BASE_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY . /src
RUN python3 -m venv /opt/smg \
 && if [ -d /src/wheelhouse ]; then \
      /opt/smg/bin/pip install --no-index --find-links=/src/wheelhouse smg-router-py; \
    else \
      /opt/smg/bin/pip install /src; \
    fi \
 && mkdir /opt/smg/tokenizers \
 && cp -R "$(/opt/smg/bin/python3 -c 'from smg_sim.tokenizer_files import TOKENIZER_DIR; print(TOKENIZER_DIR)')" \
      /opt/smg/tokenizers/smg-sim \
 && /opt/smg/bin/pip uninstall --yes --quiet pip setuptools \
 && /opt/smg/bin/python3 -m compileall -q /opt/smg \
 && chmod -R a+rX /opt/smg

# --- runtime: the base image and the virtual environment; no sources, no pip -------------------------------
FROM ${BASE_IMAGE}
ENV PATH=/opt/smg/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
COPY --from=builder /opt/smg /opt/smg
LABEL org.opencontainers.image.title="smg" \
      org.opencontainers.image.description="SMG: a Kubernetes-native, cache-aware router for LLM inference fleets" \
      org.opencontainers.image.licenses="Apache-2.0"
# A uid with no passwd entry; group 0 as OpenShift assigns. Any other uid works the same.
USER 10001:0
WORKDIR /tmp
EXPOSE 30000
# Exec form: the command is PID 1 itself (no shell in between), so SIGTERM reaches its handler.
CMD ["smg-router"]
