# grpc-ps worker (ps-worker) for NVIDIA GPUs, on the official PyTorch CUDA runtime image (its
# torch is used as is). Build from the repository root:
#   docker build -f deploy/docker/worker-gpu.Dockerfile -t grpc-ps-worker-gpu:0.1.0 .
# Pick the pytorch/pytorch tag that matches your driver's CUDA version with
#   --build-arg PYTORCH_TAG=<torch>-cuda<X.Y>-cudnn9-runtime
# Run with the NVIDIA container toolkit (docker compose --profile gpu, or nvidia.com/gpu on k8s).
# No multi-stage build here: the CUDA base is nearly all of the image, and a second stage
# would copy it whole.

ARG PYTORCH_TAG=2.13.0-cuda12.8-cudnn9-runtime
FROM pytorch/pytorch:${PYTORCH_TAG}
LABEL org.opencontainers.image.title="grpc-ps-worker-gpu" \
      org.opencontainers.image.description="grpc-ps worker (CUDA): trains a workload through grpc-ps shards" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY . .
# The base image's torch satisfies grpc-ps's torch requirement, so pip keeps it (no CPU wheel).
RUN pip install --no-cache-dir . \
 && python -c "import torch, ps_worker.workloads.cli, ps_worker.entrypoint; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
# glibc malloc tuned for large gRPC messages (measured 1.4x-6x faster push/pull of multi-MiB
# partitions): huge pages, no mmap per large buffer, no trimming, one arena. The price is RSS:
# memory freed by the process is kept for reuse instead of returned to the system. (CUDA's own
# allocator is unaffected; this is host memory.)
ENV GLIBC_TUNABLES=glibc.malloc.hugetlb=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4000000000:glibc.malloc.arena_max=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PS_DEVICE=cuda \
    PS_METRICS_PORT=8000
RUN groupadd --system --gid 10001 grpc-ps \
 && useradd --system --uid 10001 --gid grpc-ps --home-dir /tmp --no-create-home --shell /usr/sbin/nologin grpc-ps
USER 10001:10001
WORKDIR /tmp
EXPOSE 8000
# A worker is a batch process with no gRPC server of its own: it is healthy while it runs, and
# its exit code says how training went. (Its /metrics port shows progress once it is serving.)
HEALTHCHECK NONE
# No CMD: the workload comes from PS_WORKLOAD (digits when unset), or an argument after the image.
# ps_worker.entrypoint runs a user's script instead when one is named: `train.py [args]`, `-m
# pkg.mod [args]`, or PS_SCRIPT / PS_MODULE (docs/user-script-deploy.md); it execs, so signals and
# the exit status are the program's own.
ENTRYPOINT ["python", "-m", "ps_worker.entrypoint"]
