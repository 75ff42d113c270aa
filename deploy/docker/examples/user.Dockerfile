# Bring your own image: grpc-ps's worker image with your training script (and its dependencies)
# in it. Build the worker image first, then, from the directory that holds train.py:
#   docker build -f deploy/docker/worker.Dockerfile -t grpc-ps-worker:0.1.0 .
#   docker build -f deploy/docker/examples/user.Dockerfile -t my-training:1 .
#   docker run --rm -e PS_SERVERS=ps-0:50051,ps-1:50051 -e PS_RANK=0 -e PS_NUM_WORKERS=2 \
#     -e PS_TOKEN=... my-training:1 --epochs 3
# The entry point stays ps_worker.entrypoint: PS_SCRIPT runs the script, with the arguments
# after the image as its own (docs/user-script-deploy.md). For GPUs, start FROM grpc-ps-worker-gpu.
# checkov:skip=CKV_DOCKER_7:the tag is in WORKER_IMAGE (default grpc-ps-worker:0.1.0), which checkov does not expand
ARG WORKER_IMAGE=grpc-ps-worker:0.1.0
FROM ${WORKER_IMAGE}
# Extra Python packages of your script, if any (the image's venv is first on PATH):
#   RUN pip install --no-cache-dir 'torchvision==0.28.0'
WORKDIR /opt/grpc-ps-user
COPY --chown=10001:10001 train.py ./
ENV PS_SCRIPT=/opt/grpc-ps-user/train.py
USER 10001:10001
# A batch process, as the worker image says: its exit code tells how training went.
HEALTHCHECK NONE
