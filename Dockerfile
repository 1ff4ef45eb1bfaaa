# syntax=docker/dockerfile:1
# One image, two entrypoints:
#   operator:  kopf run -m tokenfair_operator.handlers --all-namespaces   (charts/tokenfair)
#   sidecar:   tokenfair sidecar --config FILE --listen 0.0.0.0:8080 --admin-listen 0.0.0.0:9090
# Build:       docker build -t tokenfair/tokenfair:0.1.0 .
# Dependencies: requirements/image.txt (`make lock`), every package pinned and installed
#              --require-hashes, the build backend included; tokenfair itself then --no-deps.
# Offline:     a `wheels/` folder in the context (the lock's wheels for this Python) and
#              --build-arg PIP_INSTALL_ARGS="--no-index --find-links=/src" install from it
#              instead of the package index: what `make image` does (docs/node.md).
# Runs as UID 10001 with a read-only root filesystem: nothing is written at run time except /tmp
# (the chart mounts an emptyDir there), bytecode is compiled at build time.

# Python 3.11 on Debian 12, as in development and CI; pinned by digest (the tag moves). To move
# it: `docker buildx imagetools inspect python:3.11-slim-bookworm`, the index's Digest here.
# `make image` passes its own debootstrapped Debian 12 base instead (docs/node.md).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:2e32f7d302adc1c37428355c1e646897c0c53f4fd60b6a551245fb90ee129f91
# Extra `pip install` options, e.g. an offline wheelhouse (see above); empty: the package index.
ARG PIP_INSTALL_ARGS=""

# --- build: a virtualenv holding tokenfair with the operator extra (kopf, kubernetes, crypto) ---
FROM ${PYTHON_IMAGE} AS build
ARG PIP_INSTALL_ARGS
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/tokenfair
WORKDIR /src
# Only what the install reads (.dockerignore keeps the rest out of the context). The locked
# dependencies first, so a source edit reuses their layer. `wheel[s]` matches an optional
# wheelhouse folder (its files land in /src); with none, nothing.
COPY requirements/image.txt wheel[s] ./
RUN /opt/tokenfair/bin/pip install --no-compile ${PIP_INSTALL_ARGS} --require-hashes -r image.txt
COPY pyproject.toml README.md ./
COPY sidecar/tokenfair sidecar/tokenfair
COPY operator/tokenfair_operator operator/tokenfair_operator
# Built with the locked setuptools already in the virtualenv, not a fresh unpinned one.
RUN /opt/tokenfair/bin/pip install --no-compile ${PIP_INSTALL_ARGS} --no-deps \
      --no-build-isolation . \
 && /opt/tokenfair/bin/python -m compileall -q /opt/tokenfair/lib

# --- run: the same Python, the virtualenv, no compilers, pip or sources ------------------------
FROM ${PYTHON_IMAGE}
RUN groupadd --gid 10001 tokenfair \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin tokenfair
COPY --from=build /opt/tokenfair /opt/tokenfair
RUN /opt/tokenfair/bin/python -m pip uninstall --yes --quiet pip
ENV PATH=/opt/tokenfair/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Numeric, so the kubelet can verify runAsNonRoot without reading /etc/passwd.
USER 10001:10001
WORKDIR /tmp
EXPOSE 8080 9090 9443
CMD ["tokenfair", "--help"]
