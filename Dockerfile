# syntax=docker/dockerfile:1
#
# One image for every kvgate service; the command picks the service:
#   docker run --rm kvgate:latest router --help
#   docker run --rm kvgate:latest sim-worker --count 4
# compose.yaml builds it once (service `migrate`) and every other service reuses the tag.
#
# Stage 1 installs the package and its dependencies into a virtual environment at /opt/venv;
# stage 2 copies only that environment onto a fresh slim base and runs as a non-root user.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------- build
FROM ${PYTHON_IMAGE} AS build

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src

# A C compiler for the index core's C extension (services/core/_cindex.c, built by setup.py).
# Only this stage has it: the runtime stage copies the built environment.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# Dependencies first (their own layer, rebuilt only when pyproject.toml changes).
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies']))" > requirements.txt \
    && pip install --no-cache-dir -r requirements.txt

# Then the project itself (non-editable; migrations ship inside the package).
COPY README.md setup.py ./
COPY services ./services
COPY migrations ./migrations
COPY bench ./bench
RUN pip install --no-cache-dir --no-deps . \
    && kvgate --help > /dev/null

# ---------------------------------------------------------------------------- runtime
FROM ${PYTHON_IMAGE} AS runtime

LABEL org.opencontainers.image.title="kvgate" \
      org.opencontainers.image.description="KV-cache-aware routing control plane for LLM inference fleets" \
      org.opencontainers.image.licenses="Apache-2.0"

RUN groupadd --system --gid 10001 kvgate \
    && useradd --system --no-log-init --uid 10001 --gid kvgate --create-home \
       --home-dir /home/kvgate --shell /usr/sbin/nologin kvgate \
    && install -d -o kvgate -g kvgate /var/lib/kvgate

COPY --from=build /opt/venv /opt/venv

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

USER 10001:10001
WORKDIR /var/lib/kvgate

# router 8080, api 8081, kv_indexer 8082, telemetry 8083, simulated workers 8100+
EXPOSE 8080 8081 8082 8083 8100

# Health checks are per service (compose.yaml): each service has its own port and path.
ENTRYPOINT ["kvgate"]
CMD ["--help"]
