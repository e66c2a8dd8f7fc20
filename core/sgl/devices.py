"""Which torch device the engine runs on (``--device``)."""

from __future__ import annotations

import torch

__all__ = ["DEVICE_CHOICES", "describe_device", "resolve_device"]

#: ``--device`` values
DEVICE_CHOICES = ("auto", "cpu", "cuda")


def resolve_device(name: str | torch.device) -> torch.device:
    """The torch device of ``--device name``: ``auto`` is ``cuda`` when torch sees a GPU,
    else ``cpu``. Any other torch device (``cuda:1``, ``meta`` in tests) is taken as it is;
    ValueError when CUDA is asked for and torch sees none, saying why."""
    if isinstance(name, torch.device):
        device = name
    elif name == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(name)
        except RuntimeError:
            raise ValueError(f"unknown device {name!r}; expected one of "
                             f"{', '.join(DEVICE_CHOICES)}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        build = (f"torch {torch.__version__} is built without CUDA"
                 if torch.version.cuda is None else
                 f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no GPU")
        raise ValueError(f"--device cuda: {build}; run with --device cpu, or install a CUDA "
                         "build of torch on a machine with an NVIDIA GPU")
    return device


def describe_device(device: torch.device) -> str:
    """``cuda:0 (NVIDIA H200, 139.8 GiB)`` or ``cpu``, for the start-up log."""
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return f"cuda:{index} ({props.name}, {props.total_memory / 2**30:.1f} GiB)"
