"""Copies between host and device that never stop the host: queue the copy now, wait later."""

from __future__ import annotations

import torch


class HostCopy:
    """`src` copied to pinned memory on the current stream; `get()` waits for that copy alone."""

    __slots__ = ("_host", "_event")

    def __init__(self, src: torch.Tensor):
        if not src.is_cuda:
            self._host, self._event = src, None
            return
        self._host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        self._host.copy_(src, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def get(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device`, pinned first: a pageable copy would sync the stream."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
