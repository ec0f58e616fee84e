"""The device and the process-group backend follow the model's parameters (tidal.worker.placement)."""

from __future__ import annotations

import pytest
import torch

from tidal.worker.api import UsageError
from tidal.worker.placement import choose_backend, model_device

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def test_a_cpu_model_talks_gloo_even_where_cuda_is_visible() -> None:
    assert choose_backend(CPU, None, own_gpu=True) == ("gloo", None)


def test_a_gpu_model_with_a_gpu_of_its_own_talks_nccl() -> None:
    assert choose_backend(CUDA, None, own_gpu=True) == ("nccl", None)


def test_workers_sharing_a_gpu_fall_back_to_gloo_and_say_so() -> None:
    backend, warning = choose_backend(CUDA, None, own_gpu=False)
    assert backend == "gloo" and warning is not None and "share a GPU" in warning
    assert "\n" not in warning


def test_a_user_can_force_either() -> None:
    assert choose_backend(CUDA, "gloo", own_gpu=True) == ("gloo", None)
    assert choose_backend(CUDA, "nccl", own_gpu=False) == ("nccl", None)
    with pytest.raises(UsageError, match="CPU"):
        choose_backend(CPU, "nccl", own_gpu=True)
    with pytest.raises(UsageError, match="unknown communication backend"):
        choose_backend(CPU, "mpi", own_gpu=True)


def test_the_device_is_the_parameters_one() -> None:
    assert model_device(list(torch.nn.Linear(2, 2).parameters())) == CPU
    assert model_device([]) == CPU
    meta = torch.nn.Linear(2, 2, device="meta")
    assert model_device(list(meta.parameters())).type == "meta"
    with pytest.raises(UsageError, match="several devices"):
        model_device([*torch.nn.Linear(2, 2).parameters(), *meta.parameters()])
