"""A DDP training program: torchrun-launched or single-process, CPU (gloo) or GPU (NCCL)."""
