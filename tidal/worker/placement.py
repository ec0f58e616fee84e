"""Where a worker computes and how its process groups talk: decided from the model, not the machine.

Before, a worker picked nccl whenever ``torch.cuda.is_available()``, so a CPU model on a machine
with a GPU got an NCCL group (and every worker took ``cuda:0``), and the reduction buffers lived
on whichever device the backend implied, not where the gradients were. Now:

* the device is that of the model's parameters (``State`` knows them);
* CPU parameters: gloo. CUDA parameters: nccl when this worker has a GPU of its own (the local
  backend sets ``TIDAL_OWN_GPU=1`` with one ``CUDA_VISIBLE_DEVICES`` entry per worker), else gloo
  over CUDA tensors, with a one-line warning (NCCL refuses two ranks on one GPU);
* ``tidal.worker.init(backend=...)`` or ``TIDAL_COMM_BACKEND`` forces either.

Pure functions; the worker runtime calls them when ``job.state(model, ...)`` is called.
"""

from __future__ import annotations

import logging

import torch

from tidal.worker.api import UsageError

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")


def model_device(parameters: list[torch.Tensor]) -> torch.device:
    """The one device the parameters live on (CPU for a model without parameters).

    Raises:
        UsageError: the parameters are spread over several devices (not data parallel).
    """
    devices = {p.device for p in parameters}
    if len(devices) > 1:
        raise UsageError(f"the model's parameters are on several devices {sorted(map(str, devices))}; "
                         "tidal trains data-parallel replicas that each live on one device")
    return devices.pop() if devices else torch.device("cpu")


def choose_backend(device: torch.device, forced: str | None, own_gpu: bool) -> tuple[str, str | None]:
    """The process-group backend for parameters on ``device``; the second value is a warning to
    print once, or None.

    Raises:
        UsageError: an unknown backend, or nccl forced for a CPU model.
    """
    if forced is not None:
        if forced not in BACKENDS:
            raise UsageError(f"unknown communication backend {forced!r}; use one of {', '.join(BACKENDS)}")
        if forced == "nccl" and device.type != "cuda":
            raise UsageError("nccl needs the model on a CUDA device; this model is on the CPU")
        return forced, None
    if device.type != "cuda":
        return "gloo", None
    if own_gpu:
        return "nccl", None
    return "gloo", ("tidal: workers share a GPU, so their process groups use gloo over CUDA tensors "
                    "(NCCL needs one GPU per worker; run with --workers MAX no larger than the GPU count)")
