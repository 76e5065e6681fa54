"""The model's weights an optimized module no longer reads, moved to host memory.

Once FP8 has packed a weight at load time (``kopt.passes.fold``), the graph reads the packed
copy and the BF16 original stays alive only through the model: W1's 38 GiB beside 19 GiB of
packed weights. :class:`HostCopies` copies such a weight's storage to (pinned) host memory and
resizes the device storage to nothing, so the parameter objects, their shapes and the model
stay as they are while the device memory is freed. Everything that would read the values again
(the original model's forward, capturing a new input signature, re-packing after an in-place
change) runs inside :meth:`HostCopies.on_device`, which copies them back for its duration,
bit for bit.

While an optimization runs inside :func:`releasing`, ``fold_constants`` hands each weight to
:func:`release` as soon as the last packed constant computed from it is stored: the BF16 copy
leaves while FP8 packs the next one, so the peak stays near the model's size instead of the
model plus its packed copy. What is released and later found still needed (a pass reverted, a
folded value left per call) comes back through :func:`give_back`.

With FP8 the copies to host memory are made ahead: as the block starts, threads of their own
copy the owned weights to host memory on side streams (:class:`_Ahead`), while the
optimization runs on the host (capture, tracing, Triton's compiler) and the copy engines would
idle. A release then frees the device storage at once if its copy is made, and the copy is used
only if the weight is unchanged since (the same storage, alive throughout, its tensors' version
counters as they were); otherwise the release copies it then, as it would without them.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch.multiprocessing.reductions import StorageWeakRef

log = logging.getLogger("kopt")

# Devices whose weights are moved to host memory: where memory is scarce and the host's is not
# the same memory (the CPU tests add "cpu" to exercise the mechanism).
OFFLOAD_DEVICES: tuple[str, ...] = ("cuda",)
# Storages smaller than this stay (a rotary table's 32 bytes are not worth a round trip).
MIN_BYTES = 1 << 20

# storage identity -> the HostCopies holding its bytes, for whatever meets a moved weight
_HOLDERS: weakref.WeakValueDictionary[int, HostCopies] = weakref.WeakValueDictionary()
# (holder, storages it may take) of the innermost releasing() block; None: release nothing
_RELEASING: list[tuple[HostCopies, set[int]] | None] = []


@contextmanager
def releasing(holder: HostCopies | None, owned: Iterable[torch.Tensor] = (),
              ahead: bool = False) -> Iterator[None]:
    """Within the block, :func:`release` moves to ``holder`` the storages of ``owned`` (the
    model's weights) it is given; with ``holder=None`` it moves nothing (a nested block where
    the weights must stay, e.g. a check that runs the graph before a pass again). ``ahead``:
    most of them are expected to go (FP8 packs them), so their host copies start at once
    (:meth:`HostCopies.copy_ahead`); the holder keeps those no release took until
    :meth:`HostCopies.drop_ahead`."""
    owned = list(owned)
    keys = {t.untyped_storage()._cdata for t in owned}
    _RELEASING.append((holder, keys) if holder is not None else None)
    if holder is not None and ahead:
        holder.copy_ahead(owned)
    try:
        yield
    finally:
        _RELEASING.pop()
        if holder is not None:
            holder.stop_ahead()


def release(tensors: Iterable[torch.Tensor]) -> int:
    """Move the storages of ``tensors`` that the enclosing :func:`releasing` block owns to its
    holder; returns the bytes moved (0 outside such a block)."""
    current = _RELEASING[-1] if _RELEASING else None
    if current is None:
        return 0
    holder, owned = current
    if holder._depth:  # a new signature optimized beside the moved weights: the module decides
        return 0
    return holder.move([t for t in tensors if t.untyped_storage()._cdata in owned], quiet=True)


def repointed(old: Iterable[torch.Tensor], new: torch.Tensor) -> None:
    """The model's weights ``old`` now view ``new`` (``fold_constants``'s in-place packing): its
    storage is the model's, to release as theirs were. Call before re-pointing them."""
    current = next((c for c in reversed(_RELEASING) if c is not None), None)
    keys = {t.untyped_storage()._cdata for t in old}
    if current is not None and keys & current[1]:
        current[1].difference_update(keys)  # (freed once re-pointed: their ids may recur)
        current[1].add(new.untyped_storage()._cdata)


def copied_out(tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Host copies of ``tensors`` (whole storages), each device storage freed as soon as it is
    copied, for a value to be rebuilt from them on the device without the device holding both
    (``fold_constants``'s largest concatenations of weights). None, with nothing moved, unless
    the enclosing :func:`releasing` block may move every one of them. :func:`put_back` undoes
    it."""
    current = _RELEASING[-1] if _RELEASING else None
    if current is None or current[0]._depth or not all(
            t.device.type in OFFLOAD_DEVICES and t.untyped_storage()._cdata in current[1]
            and t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in tensors):
        return None
    hosts = []
    for t in tensors:
        storage = t.untyped_storage()
        host = current[0].take_ahead(storage)
        hosts.append(host if host is not None else _to_host(_as_bytes(storage)))
        storage.resize_(0)
    return hosts


def put_back(tensors: list[torch.Tensor], hosts: list[torch.Tensor]) -> None:
    """The storages :func:`copied_out` freed, back on their device with their bytes."""
    for t, host in zip(tensors, hosts, strict=True):
        _refill(t.untyped_storage(), host)


def released() -> set[int]:
    """The storages (by identity) moved so far by the enclosing :func:`releasing` block's
    holder: what :func:`give_back` can return to."""
    current = _RELEASING[-1] if _RELEASING else None
    return set(current[0]._moved) if current is not None else set()


@contextmanager
def on_device() -> Iterator[None]:
    """What the enclosing :func:`releasing` block's holder moved, back on the device for the
    block's duration (to run the graph as captured)."""
    current = _RELEASING[-1] if _RELEASING else None
    if current is None:
        yield
        return
    with current[0].on_device():
        yield


def give_back(keys: Iterable[int]) -> int:
    """Put the storages ``keys`` (from :func:`released`) back on their device; the holder
    forgets them (it may take them again later). Returns how many came back."""
    current = _RELEASING[-1] if _RELEASING else None
    return current[0].give_back(keys) if current is not None else 0


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


def holder(tensor: torch.Tensor) -> HostCopies | None:
    """The holder of ``tensor``'s storage if it was moved (and not given back), else None."""
    return _HOLDERS.get(tensor.untyped_storage()._cdata)


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of ``storage``."""
    out = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return out.set_(storage, 0, (storage.nbytes(),), (1,))


def _refill(storage: torch.UntypedStorage, host: torch.Tensor) -> None:
    """A storage emptied for host memory, back on its device with the bytes ``host`` holds."""
    if storage.nbytes() == 0:
        storage.resize_(host.numel())
        _as_bytes(storage).copy_(host)


# D2H copies go through two pinned buffers of this size into pageable host memory: pinning
# the whole destination costs more than the copy (12 GiB of W1-block-shaped tensors: pinned
# per storage at 1.49 GiB/s, against 12 GiB/s staged and 2.4 GiB/s copied into fresh pageable
# memory directly; H100, RESULTS.md 2026-12-06)
STAGE_BYTES = 64 << 20
_STAGES: list[torch.Tensor] = []  # the two pinned buffers, made at the first copy


def _to_host(src: torch.Tensor, stages: list[torch.Tensor] | None = None,
             stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """A pageable host copy of the uint8 tensor ``src``: a CUDA tensor's through two pinned
    buffers (``stages``, else this module's), a chunk's copy from the device overlapping the
    host copy of the one before, on ``stream`` (else the current one)."""
    host = torch.empty(src.numel(), dtype=torch.uint8)
    if src.device.type != "cuda":
        host.copy_(src)
        return host
    if stages is None:
        if not _STAGES:
            _STAGES.extend(torch.empty(STAGE_BYTES, dtype=torch.uint8, pin_memory=True)
                           for _ in range(2))
        stages = _STAGES
    stream = stream if stream is not None else torch.cuda.current_stream(src.device)
    events = [torch.cuda.Event(), torch.cuda.Event()]
    last = None  # (offset, length, buffer index) of the chunk on its way
    with torch.cuda.stream(stream):
        for j, start in enumerate(range(0, src.numel(), STAGE_BYTES)):
            n = min(STAGE_BYTES, src.numel() - start)
            stages[j % 2][:n].copy_(src[start:start + n], non_blocking=True)
            events[j % 2].record(stream)
            if last is not None:
                o, k, b = last
                events[b].synchronize()
                host[o:o + k].copy_(stages[b][:k])
            last = (start, n, j % 2)
    o, k, b = last
    events[b].synchronize()
    host[o:o + k].copy_(stages[b][:k])
    return host


class HostCopies:
    """Device storages moved to host memory, by storage: tensors that share a storage (tied
    weights, views) move and come back together."""

    def __init__(self) -> None:
        # storage identity -> (the storage, its bytes in host memory)
        self._moved: dict[int, tuple[torch.UntypedStorage, torch.Tensor]] = {}
        self._depth = 0  # nested on_device() blocks
        self.done = False  # restored for good: moves nothing more
        self._ahead: _Ahead | None = None  # host copies made ahead of the releases

    @property
    def nbytes(self) -> int:
        """Bytes held in host memory for storages now off the device."""
        return 0 if self._depth else sum(h.numel() for _, h in self._moved.values())

    def __len__(self) -> int:
        return 0 if self._depth else len(self._moved)

    def move(self, tensors: Iterable[torch.Tensor], quiet: bool = False) -> int:
        """Move the storages of ``tensors`` on :data:`OFFLOAD_DEVICES` to host memory; returns
        the bytes moved. Inside :meth:`on_device` they are moved when the block ends.
        ``quiet``: no log line (one weight at a time, as ``fold_constants`` releases them)."""
        moved = 0
        for t in tensors:
            storage = t.untyped_storage()
            key = storage._cdata
            if (self.done or t.device.type not in OFFLOAD_DEVICES
                    or storage.nbytes() < max(MIN_BYTES, 1)):
                continue
            if key in self._moved and not self._depth:
                continue
            if self._depth:
                if key not in self._moved:  # moved when the on_device() block ends
                    self._moved[key] = (storage, torch.empty(0, dtype=torch.uint8))
                    _HOLDERS[key] = self
                continue
            host = self.take_ahead(storage)
            if host is None:
                host = _to_host(_as_bytes(storage))
            self._moved[key] = (storage, host)
            _HOLDERS[key] = self
            storage.resize_(0)
            moved += host.numel()
        if moved and not quiet:
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
                for key, (storage, _) in list(self._moved.items()):
                    self._moved[key] = (storage, _to_host(_as_bytes(storage)))
                    storage.resize_(0)

    @property
    def keys(self) -> set[int]:
        """The storages (by identity) this holder took, on the device now or not."""
        return set(self._moved)

    @property
    def moved(self) -> bool:
        """Whether storages are off their device now."""
        return bool(self._moved) and self._depth == 0

    def copy_ahead(self, tensors: Iterable[torch.Tensor]) -> None:
        """Start copying the storages of ``tensors`` to host memory on threads of their own,
        in order, for :meth:`move` to take (nothing if copies are under way already)."""
        if self._ahead is None and not self.done:
            try:
                self._ahead = _Ahead.start(tensors)
            except Exception as e:  # noqa: BLE001 -- an optimization: the releases copy
                log.info("kopt: no host copies made ahead (%s: %s)", type(e).__name__, e)

    def stop_ahead(self) -> None:
        """No more copies ahead: the threads end after the copies in progress; the copies made
        stay for :meth:`move` until :meth:`drop_ahead`."""
        if self._ahead is not None:
            self._ahead.stop()

    def drop_ahead(self) -> None:
        """Stop the copies ahead and free the host memory of those no release took."""
        if self._ahead is not None:
            self._ahead.stop()
            ahead, self._ahead = self._ahead, None
            if ahead.copied:
                log.info("kopt: %.2f GiB of weights copied to host memory ahead of their "
                         "release, in %.1f s; %.2f GiB of them released", ahead.copied / 2**30,
                         ahead.busy, ahead.taken / 2**30)

    def take_ahead(self, storage: torch.UntypedStorage) -> torch.Tensor | None:
        """The host copy made ahead of ``storage`` if its bytes are the storage's now, else
        None (the caller copies it)."""
        return self._ahead.take(storage) if self._ahead is not None else None

    def restore(self) -> None:
        """Every moved storage back on its device for good; nothing moves from then on."""
        self.drop_ahead()
        if self._depth == 0:
            self._bring_back()
        for key in self._moved:
            _HOLDERS.pop(key, None)
        self._moved.clear()
        self.done = True

    def give_back(self, keys: Iterable[int]) -> int:
        """The storages ``keys`` back on their device, and forgotten (not for good: they may be
        moved again); returns how many came back."""
        back = 0
        for key in list(keys):
            entry = self._moved.pop(key, None)
            if entry is None:
                continue
            _HOLDERS.pop(key, None)
            _refill(*entry)
            back += 1
        return back

    def _bring_back(self) -> None:
        for storage, host in self._moved.values():
            _refill(storage, host)


# Threads that copy ahead, each with its own stream and pinned buffers: one thread's copy is
# bound by the first touch of fresh pageable memory, not the link (a staged 4 GiB copy: 0.48 s
# into fresh memory, 0.20 s into touched; RESULTS.md, 2026-12-07, H100).
AHEAD_THREADS = 2
# While copies ahead run, the interpreter hands the lock over this often (s): each chunk needs
# it three times, and the optimization's own thread would otherwise hold it 5 ms at a time.
AHEAD_SWITCH_INTERVAL = 5e-4


_RUNNING: weakref.WeakSet[_Ahead] = weakref.WeakSet()  # copies ahead whose threads run


def stop_copies_ahead() -> None:
    """End every thread copying ahead (what is left is copied at its release): before a CUDA
    graph capture, during which no other thread may wait on the device."""
    for ahead in list(_RUNNING):
        ahead.stop()


class _Copy:
    """One storage to copy ahead: a weak reference (the storage may die meanwhile; while the
    reference lives its identity is not reused), the tensors over it with their version
    counters as they were, and, once copied, its bytes in host memory."""

    __slots__ = ("ref", "tensors", "versions", "host", "state", "done")

    def __init__(self, storage: torch.UntypedStorage, tensors: list[torch.Tensor]) -> None:
        self.ref = StorageWeakRef(storage)
        self.tensors = [weakref.ref(t) for t in tensors]  # (copying ahead keeps nothing alive)
        self.versions = [t._version for t in tensors]
        self.host: torch.Tensor | None = None
        self.state = "waiting"  # -> "copying" -> "copied" | "failed"; or "taken" (by move)
        self.done = threading.Event()

    def unchanged(self, storage: torch.UntypedStorage) -> bool:
        """Whether the copy holds ``storage``'s bytes now: no tensor over it written since."""
        key = storage._cdata
        return (not self.ref.expired() and self.ref.cdata == key
                and self.host is not None and self.host.numel() == storage.nbytes()
                and all(t._version == v for r, v in zip(self.tensors, self.versions,
                                                         strict=True)
                        if (t := r()) is not None and t.untyped_storage()._cdata == key))


class _Ahead:
    """Host copies of weights made on background threads before they are released."""

    def __init__(self, copies: dict[int, _Copy]) -> None:
        self._copies = copies
        self._lock = threading.Lock()
        self._stopped = False
        self._threads: list[threading.Thread] = []
        self._interval: float | None = None
        self.copied = 0  # bytes the threads copied
        self.taken = 0  # bytes of those the releases took
        self._started = time.perf_counter()
        self.busy = 0.0  # seconds from the start until the threads' last copy was made

    @classmethod
    def start(cls, tensors: Iterable[torch.Tensor]) -> _Ahead | None:
        by_storage: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
        for t in tensors:
            storage = t.untyped_storage()
            if (t.device.type in OFFLOAD_DEVICES and storage.nbytes() >= max(MIN_BYTES, 1)
                    and storage._cdata not in _HOLDERS):
                by_storage.setdefault(storage._cdata, (storage, []))[1].append(t)
        if not by_storage:
            return None
        ahead = cls({k: _Copy(s, ts) for k, (s, ts) in by_storage.items()})
        order = list(ahead._copies.values())
        devices = {s.device for s, _ in by_storage.values()}
        # the copies read what the device's queue has written so far
        ready = {d: torch.cuda.current_stream(d).record_event() for d in devices
                 if d.type == "cuda"}
        ahead._interval = sys.getswitchinterval()
        sys.setswitchinterval(min(ahead._interval, AHEAD_SWITCH_INTERVAL))
        _RUNNING.add(ahead)
        for i in range(AHEAD_THREADS):
            thread = threading.Thread(target=ahead._work, args=(order[i::AHEAD_THREADS], ready),
                                      name=f"kopt-copy-ahead-{i}", daemon=True)
            ahead._threads.append(thread)
            thread.start()
        return ahead

    def stop(self) -> None:
        """Let the threads end (after the copy each is making) and wait for them."""
        self._stopped = True
        for thread in self._threads:
            thread.join()
        self._threads.clear()
        _RUNNING.discard(self)
        if self._interval is not None:
            sys.setswitchinterval(self._interval)
            self._interval = None

    def take(self, storage: torch.UntypedStorage) -> torch.Tensor | None:
        copy = self._copies.pop(storage._cdata, None)
        if copy is None:
            return None
        with self._lock:
            if copy.state == "waiting":
                copy.state = "taken"
                return None
        copy.done.wait()
        if not copy.unchanged(storage):
            return None
        self.taken += copy.host.numel()
        return copy.host

    def _work(self, copies: list[_Copy], ready: dict[torch.device, torch.cuda.Event]) -> None:
        stages: list[torch.Tensor] = []
        streams: dict[torch.device, torch.cuda.Stream] = {}
        for copy in copies:
            if self._stopped:
                break
            with self._lock:
                if copy.state != "waiting":
                    continue
                copy.state = "copying"
            try:
                storage = torch.UntypedStorage._new_with_weak_ptr(copy.ref.cdata)
                if storage is None:
                    copy.state = "failed"
                    continue
                src = _as_bytes(storage)
                if src.device.type == "cuda":
                    stream = streams.get(src.device)
                    if stream is None:
                        stream = streams[src.device] = torch.cuda.Stream(src.device)
                        stream.wait_event(ready[src.device])
                    if not stages:
                        stages = [torch.empty(STAGE_BYTES, dtype=torch.uint8, pin_memory=True)
                                  for _ in range(2)]
                    copy.host = _to_host(src, stages, stream)
                else:
                    copy.host = src.clone()
                copy.state = "copied"
                with self._lock:
                    self.copied += copy.host.numel()
                    self.busy = time.perf_counter() - self._started
                del storage, src
            except Exception as e:  # the release copies it itself
                log.debug("kopt: a copy ahead failed (%s); the release copies it", e)
                copy.state = "failed"
            finally:
                copy.done.set()
