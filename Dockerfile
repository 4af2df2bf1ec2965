# The trainer image. The base provides python3 (as `python`), torch and torchvision; the default
# is a pinned CUDA runtime image. Tests build this same file on a local CPU base:
#   docker build --build-arg BASE_IMAGE=ddp-base:cpu -t ddp-trainer:test .
ARG BASE_IMAGE=pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Dependencies first: a code-only change reuses every layer up to the COPY of agent/ and trainer/.
COPY docker/requirements.txt /tmp/requirements.txt
RUN python -m pip install --no-cache-dir -r /tmp/requirements.txt \
 && python -c "import torch, yaml, tensorboard"

# An unprivileged user (uid/gid 1000) owns the volumes; the deploy tool creates the shared
# directories with this owner.
RUN (getent group 1000 >/dev/null || groupadd --gid 1000 trainer) \
 && (getent passwd 1000 >/dev/null || useradd --uid 1000 --gid 1000 --create-home --shell /bin/sh trainer) \
 && mkdir -p /data /ckpt && chown 1000:1000 /data /ckpt

WORKDIR /app
COPY agent /app/agent
COPY trainer /app/trainer
ENV PYTHONPATH=/app \
    DDP_DATA_DIR=/data \
    DDP_CKPT_DIR=/ckpt
VOLUME ["/data", "/ckpt"]
USER 1000:1000

# torchrun options, `--`, trainer flags; with no `--`, a standalone run on all GPUs (or 1 CPU process).
# `python -m agent.launch`, without the working directory on sys.path: a project image's WORKDIR
# (or a synced snapshot at /workspace) with an agent/ package of its own must not replace this
# launcher (agent/contract.py, RUN_MODULE).
ENTRYPOINT ["python", "-c", "import runpy, sys; sys.path[:1] = [p for p in sys.path[:1] if p]; runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)", "agent.launch"]
