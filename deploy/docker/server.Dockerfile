# grpc-ps shard (ps-server), CPU. Build from the repository root:
#   docker build -f deploy/docker/server.Dockerfile -t grpc-ps-server:0.1.0 .
# Configure with PS_* environment variables (PS_SHARD_INDEX, PS_NUM_SHARDS, PS_NUM_WORKERS, ...)
# or flags after the image name; see deploy/README.md.

# The base of both stages: the official Python image, or any Debian bookworm with python3,
# python3-venv and python-is-python3 (deploy/local-engine.sh makes one with debootstrap where no
# registry can be reached). No `# syntax=` line: BuildKit would fetch that frontend from a registry.
# checkov:skip=CKV_DOCKER_7:the tag is in BASE_IMAGE (default python:3.11-slim-bookworm), which checkov does not expand
ARG BASE_IMAGE=python:3.11-slim-bookworm

# Build stage: a virtual environment with CPU-only torch and grpc-ps. Only the environment is
# carried over, so pip, its cache and the source tree stay out of the final image.
FROM ${BASE_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Unset: PyPI. Set it (with TORCH_INDEX_URL) to build from a local index, with no network.
ARG PIP_INDEX_URL
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/grpc-ps/bin:$PATH
RUN python -m venv /opt/grpc-ps \
 && pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
# grpc-ps's dependencies first, from pyproject.toml alone: a change to the sources then rebuilds
# only the last layer, not scipy, scikit-learn and grpcio again.
COPY pyproject.toml .
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
      > /tmp/requirements.txt \
 && pip install --no-cache-dir -r /tmp/requirements.txt
COPY . .
RUN pip install --no-cache-dir . \
 && python -c "import ps_server.server, ps_server.healthcheck, ps_admin.cli, ps_worker.workloads.cli, ps_worker.workloads.digits"

FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="grpc-ps-server" \
      org.opencontainers.image.description="grpc-ps shard: sharded parameter server for PyTorch training over gRPC" \
      org.opencontainers.image.licenses="Apache-2.0"
# glibc malloc tuned for large gRPC messages (measured 1.4x-6x faster push/pull of multi-MiB
# partitions): huge pages, no mmap per large buffer, no trimming, one arena. The price is RSS:
# memory freed by the process is kept for reuse instead of returned to the system.
ENV GLIBC_TUNABLES=glibc.malloc.hugetlb=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4000000000:glibc.malloc.arena_max=1 \
    PATH=/opt/grpc-ps/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PS_HOST=0.0.0.0 \
    PS_PORT=50051 \
    PS_DATA_PORT=50052 \
    PS_METRICS_PORT=8000 \
    PS_CHECKPOINT_DIR=/var/lib/grpc-ps/checkpoints
COPY --from=build /opt/grpc-ps /opt/grpc-ps
# A fixed numeric uid, so Kubernetes can verify runAsNonRoot; it owns the checkpoint directory,
# which a fresh named volume or PVC mounted there inherits.
RUN groupadd --system --gid 10001 grpc-ps \
 && useradd --system --uid 10001 --gid grpc-ps --home-dir /var/lib/grpc-ps --shell /usr/sbin/nologin grpc-ps \
 && mkdir -p /var/lib/grpc-ps/checkpoints \
 && chown -R 10001:10001 /var/lib/grpc-ps
USER 10001:10001
WORKDIR /var/lib/grpc-ps
EXPOSE 50051 50052 8000
# gRPC health (grpc.health.v1) on 127.0.0.1:$PS_PORT; no torch import, so it is cheap. Set the
# port with PS_PORT rather than --port, so that the check follows it.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-m", "ps_server.healthcheck"]
ENTRYPOINT ["ps-server"]
