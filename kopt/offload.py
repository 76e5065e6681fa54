"""The model's weights an optimized module no longer reads, moved to host memory.

Once FP8 has packed a weight at load time (``kopt.passes.fold``), the graph reads the packed
copy and the BF16 original stays alive only through the model: W1's 38 GiB beside 19 GiB of
packed weights. :class:`HostCopies` copies such a weight's storage to (pinned) host memory and
resizes the device storage to nothing, so the parameter objects, their shapes and the model
stay as they are while the device memory is freed. Everything that would read the values again
(the original model's forward, capturing a new input signature, re-packing after an in-place
change) runs inside :meth:`HostCopies.on_device`, which copies them back for its duration,
bit for bit.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

log = logging.getLogger("kopt")

# Devices whose weights are moved to host memory: where memory is scarce and the host's is not
# the same memory (the CPU tests add "cpu" to exercise the mechanism).
OFFLOAD_DEVICES: tuple[str, ...] = ("cuda",)
# Storages smaller than this stay (a rotary table's 32 bytes are not worth a round trip).
MIN_BYTES = 1 << 20

# storage identity -> the HostCopies holding its bytes, for whatever meets a moved weight
_HOLDERS: weakref.WeakValueDictionary[int, HostCopies] = weakref.WeakValueDictionary()


def bring_back(tensors: Iterable[torch.Tensor]) -> int:
    """Put every moved storage of ``tensors`` back on its device for good, with every other
    storage its holder moved (the holder then moves nothing more); returns how many holders
    gave theirs back. For the original model called, or optimized again, after kopt moved its
    weights: it then works as it did, holding its memory again."""
    holders = {id(h): h for t in tensors  # (inside on_device() they are back already)
               if (h := _HOLDERS.get(t.untyped_storage()._cdata)) is not None and h.moved}
    for holder in holders.values():
        holder.restore()
    return len(holders)


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of ``storage``."""
    out = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return out.set_(storage, 0, (storage.nbytes(),), (1,))


def _host_buffer(storage: torch.UntypedStorage) -> torch.Tensor:
    """Host memory for ``storage``'s bytes: pinned for a GPU's (copies at the bus's rate),
    pageable where pinning fails (the host's limit on locked memory)."""
    if storage.device.type == "cuda":
        try:
            return torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:
            log.info("kopt: pinned host memory refused (%s); using pageable memory", exc)
    return torch.empty(storage.nbytes(), dtype=torch.uint8)


class HostCopies:
    """Device storages moved to host memory, by storage: tensors that share a storage (tied
    weights, views) move and come back together."""

    def __init__(self) -> None:
        # storage identity -> (the storage, its bytes in host memory)
        self._moved: dict[int, tuple[torch.UntypedStorage, torch.Tensor]] = {}
        self._depth = 0  # nested on_device() blocks
        self.done = False  # restored for good: moves nothing more

    @property
    def nbytes(self) -> int:
        """Bytes held in host memory for storages now off the device."""
        return 0 if self._depth else sum(h.numel() for _, h in self._moved.values())

    def __len__(self) -> int:
        return 0 if self._depth else len(self._moved)

    def move(self, tensors: Iterable[torch.Tensor]) -> int:
        """Move the storages of ``tensors`` on :data:`OFFLOAD_DEVICES` to host memory; returns
        the bytes moved. Inside :meth:`on_device` they are moved when the block ends."""
        moved = 0
        for t in tensors:
            storage = t.untyped_storage()
            key = storage._cdata
            if (self.done or t.device.type not in OFFLOAD_DEVICES
                    or storage.nbytes() < max(MIN_BYTES, 1)):
                continue
            if key in self._moved and not self._depth:
                continue
            if key not in self._moved:
                self._moved[key] = (storage, _host_buffer(storage))
                _HOLDERS[key] = self
            if self._depth:
                continue
            storage_, host = self._moved[key]
            host.copy_(_as_bytes(storage_))
            storage_.resize_(0)
            moved += host.numel()
        if moved:
            log.info("kopt: %.2f GiB of weights the optimized graphs no longer read moved to "
                     "host memory", moved / 2**30)
        return moved

    @contextmanager
    def on_device(self) -> Iterator[None]:
        """The moved storages back on their device, bit for bit, until the block ends."""
        if self._depth == 0:
            self._bring_back()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                for storage, host in self._moved.values():
                    host.copy_(_as_bytes(storage))
                    storage.resize_(0)

    @property
    def moved(self) -> bool:
        """Whether storages are off their device now."""
        return bool(self._moved) and self._depth == 0

    def restore(self) -> None:
        """Every moved storage back on its device for good; nothing moves from then on."""
        if self._depth == 0:
            self._bring_back()
        for key in self._moved:
            _HOLDERS.pop(key, None)
        self._moved.clear()
        self.done = True

    def _bring_back(self) -> None:
        for storage, host in self._moved.values():
            if storage.nbytes() == 0:
                storage.resize_(host.numel())
                _as_bytes(storage).copy_(host)
