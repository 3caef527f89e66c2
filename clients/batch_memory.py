"""Where a batch's tensors live: reused buffers, pinned memory, or memory shared with the trainer.

Every column of a batch is a view into one block of memory (:class:`Block`),
carved at 64-byte boundaries by :func:`edgecache.clients.tensors.assemble`,
so a batch costs one allocation whatever its number of columns. Where that
block comes from is the point of this module (measured in
docs/benchmarks.md and /work/shared/MEASURED.md):

* :class:`PinnedMemory` — ``num_workers=0`` on a CUDA host: torch's pinned
  host allocator, which caches blocks and keeps one from being reused while
  a ``non_blocking`` copy out of it may still be running.
* :class:`ReusedMemory` — ``num_workers=0`` without CUDA: buffers handed out
  again once every tensor of the batch that used one is garbage. A fresh
  multi-MiB tensor per batch page-faults on every page (the same epoch ran at
  36 k and 254 k samples/s in two identical processes); a reused one does not.
* :class:`SharedMemory` — inside a DataLoader worker: a ring of ``memfd``
  regions that the main process maps once and reads in place. torch sends a
  tensor from a worker by moving its storage into a fresh shared-memory
  segment and passing a file descriptor over a new socket connection, per
  tensor and per batch: 0.9 GB/s on this machine against 5.2–5.7 GB/s for
  this ring (2 workers, 3.2 MB batches; 6.3 GB/s for the same copies in one
  process). A slot is handed out again once the main process has dropped
  every tensor of the batch in it (a flag in a shared page, cleared by a
  finalizer there); the ring grows instead of waiting, so a trainer that
  keeps batches never deadlocks a worker.

Tensors made in a worker are :class:`_SharedTensor` views whose pickled form
names the worker, the region and the place in it; unpickling in the main
process (DataLoader does it) maps the region (``/proc/<worker>/fd/<fd>``,
once per region) and returns plain tensors. Set ``EDGECACHE_SHARED_BATCHES=0``
to use torch's own transport instead (where ``/proc`` of another process
cannot be opened).
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import resource
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import get_worker_info

__all__ = [
    "ALIGN",
    "attach",
    "on_arrival",
    "BatchMemory",
    "Block",
    "FreshMemory",
    "PinnedMemory",
    "ReusedMemory",
    "SharedMemory",
    "layout",
    "shared_memory",
]

ALIGN = 64  # every column starts on a cache line (and any dtype's alignment)
_MIB = 1 << 20
_MAX_SLOTS = 4096  # one flag byte each in one page


def layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Byte offsets of arrays of ``sizes`` placed one after the other, aligned; the total."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // ALIGN) * ALIGN
    return offsets, total


class Block:
    """One batch's memory: ``data`` (uint8), carved into column tensors by :meth:`tensor`.

    With ``source`` (the numpy array ``data`` is made of), each column is a
    tensor of its own over its bytes (no copy), holding the array alive
    through a memoryview: sharing one storage, a batch could not be saved
    (``torch.save`` refuses views of one storage as different dtypes), and a
    column saved alone wrote the whole block. Pinned blocks keep one storage:
    torch's pinned allocator tracks a ``non_blocking`` copy by the storage it
    allocated, and a block reused before the copy ends would be overwritten.
    """

    __slots__ = ("_memory", "_wrap", "data")

    def __init__(
        self,
        data: torch.Tensor,
        wrap: Callable[[torch.Tensor, int, int, torch.dtype, tuple[int, ...]], torch.Tensor]
        | None = None,
        source: np.ndarray | None = None,
    ) -> None:
        self.data, self._wrap = data, wrap
        self._memory = source.data if source is not None else None

    def array(self) -> np.ndarray:
        """The block as a writable numpy array (no copy), to fill."""
        return self.data.numpy()

    def tensor(
        self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """The column at ``offset``: ``nbytes`` viewed as ``dtype`` of ``shape`` (no copy)."""
        if self._memory is not None:
            view = _column(self._memory, offset, nbytes, dtype, shape)
        else:
            view = self.data[offset : offset + nbytes].view(dtype).view(shape)
        return self._wrap(view, offset, nbytes, dtype, shape) if self._wrap else view


def _split(array: np.ndarray) -> np.ndarray | None:
    """``array`` where a batch's columns get storages of their own: not in a DataLoader worker.

    There torch's transport sends a batch (with ``EDGECACHE_SHARED_BATCHES=0``)
    as one shared-memory segment and descriptor per storage: one per batch, not
    one per column.
    """
    return array if get_worker_info() is None else None


def _column(
    memory: memoryview, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """A tensor of its own over ``memory[offset:offset + nbytes]`` (which keeps it alive)."""
    # One call where numpy's frombuffer, from_numpy and two views took ~20 us a column.
    if not nbytes:  # torch.frombuffer refuses an empty buffer
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(
        memory, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset
    ).view(shape)


class BatchMemory(Protocol):
    """Hands out a block of at least ``nbytes`` for one batch."""

    def allocate(self, nbytes: int) -> Block:
        """A block for one batch."""
        ...


class FreshMemory:
    """A new tensor per batch (plain, or pinned): what any caller without a ring gets."""

    def __init__(self, pin_memory: bool = False) -> None:
        self.pin_memory = pin_memory

    def allocate(self, nbytes: int) -> Block:
        """A fresh block."""
        if self.pin_memory:
            return Block(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
        array = np.empty(nbytes, dtype=np.uint8)
        return Block(torch.from_numpy(array), source=_split(array))


class PinnedMemory(FreshMemory):
    """torch's caching pinned host allocator: reuses blocks, safe with ``non_blocking`` copies."""

    def __init__(self) -> None:
        super().__init__(pin_memory=True)


def _capacity(nbytes: int) -> int:
    """A buffer for ``nbytes`` with room to grow (batches of binary columns vary in size)."""
    return max(_MIB, -(-(nbytes + nbytes // 4) // _MIB) * _MIB)


class ReusedMemory:
    """Buffers reused once every tensor of the batch that used one is garbage (this process).

    Each use is a fresh numpy view of a kept buffer; the batch's tensors share
    one storage that holds that view, and a finalizer on the view returns the
    buffer. At most ``keep`` idle buffers are kept.
    """

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> Block:
        """A block in a reused buffer (a new one only when none idle is large enough)."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if len(b) >= nbytes]
            buffer = self._free.pop(min(fits, key=lambda i: len(self._free[i]))) if fits else None
        if buffer is None:
            buffer = np.empty(_capacity(nbytes), dtype=np.uint8)
        view = buffer[:nbytes]  # a new array object whose base is the buffer
        weakref.finalize(view, self._release, buffer)
        return Block(torch.from_numpy(view), source=_split(view))

    def _release(self, buffer: np.ndarray) -> None:
        with self._lock:
            self._free.append(buffer)
            if len(self._free) > self.keep:
                self._free.remove(min(self._free, key=len))

    @property
    def idle(self) -> int:
        """Buffers waiting to be reused."""
        return len(self._free)


# ---------------------------------------------------------------- shared with the trainer


class _Region:
    """One slot's memory: an anonymous memfd mapped here."""

    __slots__ = ("fd", "map", "serial", "size")

    def __init__(self, size: int, serial: int) -> None:
        self.fd = os.memfd_create(f"edgecache-batch-{serial}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            # Not mmap.mmap, which keeps a duplicate descriptor open: two per slot, and a
            # worker ran out of them (EMFILE) with half the slots the limit allows.
            self.map = _mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.size, self.serial = size, serial

    def close(self) -> None:
        # Views of the old mapping may live on in this process (a batch the worker
        # still holds); they keep the mapping, the fd is what goes.
        os.close(self.fd)


class _SlotRef:
    """Which slot of which worker's ring a batch lives in; pickled once per batch.

    All columns of a batch hold the same object, so pickle writes it once and
    the main process maps the slot once per batch (:func:`_open_slot`).
    ``extra`` rides along to the main process's :func:`on_arrival` callbacks
    (what the worker read for this batch, for the client metrics).
    """

    __slots__ = ("__weakref__", "extra", "fields", "held")

    def __init__(self, *fields: int) -> None:
        self.fields = fields
        self.extra: Any = None
        self.held: _Held | None = None  # in a worker: who still holds the batch's slot there

    def __reduce__(self) -> tuple[Any, ...]:
        if self.held is not None:
            self.held.sent = True  # the main process releases the slot from now on
        return (_open_slot, (*self.fields, self.extra))


class _Held:
    """What keeps a worker's batch slot taken there: its memory, and its columns' reference.

    The slot is freed in the worker once both are gone, unless the batch was
    sent (then the main process frees it). Its memory alone is not enough: a
    plain view of a column (``x.view(B, -1)`` in a ``collate_fn``) is sent by
    torch's transport, which moves the view's storage into new shared memory
    while the batch is being pickled; the memory died mid-send, the slot was
    freed, and the worker put its next batch in the slot the main process was
    about to map for this one.
    """

    __slots__ = ("alive", "sent")

    def __init__(self) -> None:
        self.alive = 2  # the batch's memory, and its _SlotRef
        self.sent = False


def attach(batch: dict[str, Any], extra: Any) -> bool:
    """Give ``extra`` to the main process along with ``batch``; False if it has no shared tensor."""
    for value in batch.values():
        for tensor in (value.values, value.offsets) if hasattr(value, "offsets") else (value,):
            meta = getattr(tensor, "__dict__", {}).get("_edgecache_slot")
            if meta is not None:
                meta[0].extra = extra
                return True
    return False


class _SharedTensor(torch.Tensor):
    """A column tensor in a worker's ring: pickles as a place in it, not as its bytes."""

    # No torch-function overrides: whatever a worker computes from it is a plain tensor.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __reduce_ex__(self, protocol: Any) -> Any:
        meta = self.__dict__.get("_edgecache_slot")
        if meta is None:
            return torch.Tensor.__reduce_ex__(self.as_subclass(torch.Tensor), protocol)
        return (_rebuild_column, meta)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class SharedMemory:
    """A DataLoader worker's ring of batch slots, mapped by the main process (see the module)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._serials = itertools.count(1)
        self._flags_region = _Region(mmap.PAGESIZE, next(self._serials))
        self._flags = self._flags_region.map
        self._slots: list[_Region] = []
        # Reentrant: a finalizer that frees a slot (_dropped) may run in a garbage
        # collection that allocate() itself set off, on this thread, holding the lock.
        self._lock = threading.RLock()
        # Each slot holds a descriptor open: at most a quarter of this process's limit.
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        unlimited = soft == resource.RLIM_INFINITY
        self.max_slots = _MAX_SLOTS if unlimited else min(_MAX_SLOTS, max(16, soft // 4))
        self._warned = False

    def allocate(self, nbytes: int) -> Block:
        """A block in a free slot of the ring (a new or larger slot when none fits)."""
        with self._lock:
            slot = self._take(nbytes)
            if slot is None:  # thousands of batches held by the trainer: torch's way
                # One storage for the batch: torch's transport sends a segment per storage.
                return Block(torch.empty(nbytes, dtype=torch.uint8))
            region = self._slots[slot]
            flags = self._flags_region
            ref = _SlotRef(
                self.pid,
                flags.fd,
                flags.serial,
                slot,
                region.fd,
                region.serial,
                region.size,
                nbytes,
            )
            array = region.map[:nbytes]  # a new array: its finalizer is this batch's, here
            # A batch dropped in this worker (a collate_fn or a wrapping dataset made new
            # tensors of it) never reached the main process, whose finalizer alone freed
            # the slot: the ring grew by a slot per batch until the worker ran out of
            # memory or descriptors. Its slot is freed here once neither its memory nor a
            # column of it is left, unless it was sent (see _Held).
            held = ref.held = _Held()
            weakref.finalize(array, self._dropped, held, slot)
            weakref.finalize(ref, self._dropped, held, slot)
        data = torch.from_numpy(array)

        def wrap(
            view: torch.Tensor, offset: int, size: int, dtype: torch.dtype, shape: tuple[int, ...]
        ) -> torch.Tensor:
            tensor = torch.Tensor._make_subclass(_SharedTensor, view)
            tensor._edgecache_slot = (ref, offset, size, _dtype_name(dtype), shape)  # type: ignore[attr-defined]
            return tensor

        return Block(data, wrap)

    def _dropped(self, held: _Held, slot: int) -> None:
        """Free a batch's slot once its memory and its columns' reference are gone here.

        Unless it was sent: then the main process frees it.
        """
        with self._lock:
            held.alive -= 1
            if held.alive == 0 and not held.sent:
                self._flags[slot] = 0

    def _take(self, nbytes: int) -> int | None:
        used = len(self._slots)
        free = np.flatnonzero(self._flags[:used] == 0).tolist()
        fits = [i for i in free if self._slots[i].size >= nbytes]
        try:
            if fits:
                slot = fits[0]
            elif free:  # a free slot too small for this batch: give it a larger region
                slot = free[0]
                region = _Region(_capacity(nbytes), next(self._serials))
                self._slots[slot].close()
                self._slots[slot] = region
            elif used < self.max_slots:
                slot = used
                self._slots.append(_Region(_capacity(nbytes), next(self._serials)))
            else:
                self._full(None)
                return None
        except OSError as exc:  # out of descriptors or memory: torch's transport instead
            self._full(exc)
            return None
        self._flags[slot] = 1
        return slot

    def _full(self, exc: OSError | None) -> None:
        """Say once why this worker's batches go through torch's transport from now on."""
        if self._warned:
            return
        self._warned = True
        held = int(self._flags[: len(self._slots)].sum())
        cause = f" ({exc.strerror})" if exc is not None else ""
        warnings.warn(
            f"edgecache: {held} batches of this DataLoader worker are still held by the "
            f"training process{cause}: a tensor kept from a batch (a label, an id) keeps "
            "the whole batch's memory. Its batches go through torch's shared memory from "
            "now on, slower. Keep a .clone() of what you keep from a batch (or set "
            "EDGECACHE_SHARED_BATCHES=0)",
            RuntimeWarning,
            stacklevel=3,
        )

    @property
    def slots(self) -> int:
        """Slots in the ring."""
        return len(self._slots)

    def in_use(self) -> int:
        """Slots holding a batch the main process has not released."""
        return int(self._flags[: len(self._slots)].sum())


_SHARED: dict[int, SharedMemory] = {}


def shared_memory() -> SharedMemory | None:
    """The ring of this process (one per DataLoader worker), or None where it cannot be used.

    Off with ``EDGECACHE_SHARED_BATCHES=0``, and where there is no ``memfd``.
    """
    if os.environ.get("EDGECACHE_SHARED_BATCHES", "1") == "0" or not hasattr(os, "memfd_create"):
        return None
    pid = os.getpid()
    ring = _SHARED.get(pid)
    if ring is None:
        _SHARED.clear()  # a forked child does not use its parent's ring
        ring = _SHARED[pid] = SharedMemory()
    return ring


# ------------------------------------------------------------ the main process's side

_ARRIVALS: list[Callable[[Any], None]] = []


def on_arrival(callback: Callable[[Any], None]) -> None:
    """Call ``callback(extra)`` in this process for each batch that arrives with an ``extra``."""
    if callback not in _ARRIVALS:
        _ARRIVALS.append(callback)


_MAPS: dict[int, OrderedDict[int, np.ndarray]] = {}  # worker pid → its regions, mapped here
_SLOT_SERIALS: dict[tuple[int, int], int] = {}  # (worker pid, slot) → its region now
_MAPS_LOCK = threading.Lock()
_MAPS_KEPT = 64  # per worker: more than its ring has slots
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _mmap(fd: int, size: int) -> np.ndarray:
    """``fd`` mapped shared, as a uint8 array that unmaps itself when the last view of it dies.

    Not ``mmap.mmap``: that keeps a duplicate of the descriptor open for as long
    as the mapping lives, one per region of every worker.
    """
    address = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    memory = (ctypes.c_uint8 * size).from_address(address)
    unmap = weakref.finalize(memory, _libc.munmap, address, size)
    # Not at exit: a thread still reading a batch then (DataLoader's pin-memory thread of a
    # loop left with break) crashed the process (SIGSEGV) as it ended.
    unmap.atexit = False
    return np.frombuffer(memory, dtype=np.uint8)  # type: ignore[call-overload]


def _forget_exited_workers() -> None:
    """Drop the mappings of workers that have exited (under the lock).

    A worker's regions go away once nothing here maps them; DataLoader workers
    start afresh every epoch unless persistent, so keeping theirs would grow
    without end. Views still alive keep their own mapping.
    """
    for pid in list(_MAPS):
        if not os.path.exists(f"/proc/{pid}"):
            del _MAPS[pid]
            for key in [k for k in _SLOT_SERIALS if k[0] == pid]:
                del _SLOT_SERIALS[key]


def _map(pid: int, fd: int, serial: int, size: int) -> np.ndarray:
    """The worker's region ``serial``, mapped once here (later batches reuse the mapping)."""
    with _MAPS_LOCK:
        regions = _MAPS.get(pid)
        found = None if regions is None else regions.get(serial)
        if found is not None:
            regions.move_to_end(serial)  # type: ignore[union-attr]
            return found
    path = f"/proc/{pid}/fd/{fd}"
    try:
        handle = os.open(path, os.O_RDWR)
    except OSError as exc:
        raise RuntimeError(
            f"cannot open a DataLoader worker's batch memory at {path} ({exc.strerror}); "
            "set EDGECACHE_SHARED_BATCHES=0 to send batches through torch's shared memory instead"
        ) from exc
    try:
        region = _mmap(handle, size)
    finally:
        os.close(handle)
    with _MAPS_LOCK:
        if pid not in _MAPS:
            _forget_exited_workers()
        regions = _MAPS.setdefault(pid, OrderedDict())
        regions[serial] = region
        while len(regions) > _MAPS_KEPT:
            regions.popitem(last=False)
    return region


def _release(flags: np.ndarray, slot: int) -> None:
    flags[slot] = 0


def _open_slot(
    pid: int,
    flags_fd: int,
    flags_serial: int,
    slot: int,
    fd: int,
    serial: int,
    size: int,
    nbytes: int,
    extra: Any = None,
) -> memoryview:
    """A batch's block, in the main process: released to the worker when its tensors die."""
    if extra is not None:
        for callback in _ARRIVALS:
            callback(extra)
    flags = _map(pid, flags_fd, flags_serial, mmap.PAGESIZE)
    with _MAPS_LOCK:  # the slot got a larger region: the old one is not used again
        old = _SLOT_SERIALS.get((pid, slot))
        _SLOT_SERIALS[(pid, slot)] = serial
        if old is not None and old != serial and pid in _MAPS:
            _MAPS[pid].pop(old, None)
    data = _map(pid, fd, serial, size)[:nbytes]  # a new array: its finalizer is this batch's
    weakref.finalize(data, _release, flags, slot)
    # Each column a tensor of its own that keeps ``data`` alive (see Block): a numpy
    # slice of it would name the region as its base, and the slot would be freed early.
    return data.data


def _rebuild_column(
    base: memoryview, offset: int, nbytes: int, dtype: str, shape: tuple[int, ...]
) -> torch.Tensor:
    """One column of a batch, over its bytes in the block (see :func:`_open_slot`)."""
    return _column(base, offset, nbytes, getattr(torch, dtype), shape)
