"""The device operations the Copy-Engine transport uses, behind one small interface.

`CudaBackend` maps them one to one onto CUDA calls: the runtime through CuPy (plain ``cudaMalloc``,
legacy IPC memory handles, events, ``cudaMemcpyAsync`` with ``cudaMemcpyDefault`` on non-blocking
streams; docs/GPU.md) and the driver's stream memory operations (``cuStreamWaitValue32`` /
``cuStreamWriteValue32``, V2) through NVIDIA's typed ``cuda.bindings`` where installed, else
through ctypes. `HostBackend` implements the *same* semantics on host
shared memory: a stream is a thread that runs its operations in order, after the caller queued
them (so a copy really happens later than its call, and a stream really waits on a flag word); an
IPC handle names a ``/dev/shm`` segment. The transport's protocol (ring slots, flags, credits,
ordering, teardown) is therefore exercised on CPU machines with the same code that drives the GPU;
only the CUDA calls themselves differ.

Pointers, streams and events are plain ints; stream 0 is the caller's (torch's current stream on
CUDA; on the host, the calling thread: its operations run at once). Handles are 64 bytes, as
CUDA's are. A flag is a 32-bit word compared cyclically (`flag_reached`), as
``CU_STREAM_WAIT_VALUE_GEQ`` does, so sequence numbers may wrap.
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import os
import queue
import random
import secrets
import threading
import time
from typing import Optional

import numpy as np
import torch

from deepspeed_feplb.kernels.cuda import current_stream_ptr

HANDLE_BYTES = 64
FLAG_MASK = 0xFFFFFFFF


def _memops_off(backend) -> str:
    """Why a backend built with ``stream_memops=False`` runs no stream memory operation."""
    return f"stream memory operations are off ({type(backend).__name__}(stream_memops=False))"


def flag_reached(word: int, value: int) -> bool:
    """Whether a 32-bit flag ``word`` has reached ``value``, cyclically (``(int32)(word - value) >= 0``,
    the comparison of ``CU_STREAM_WAIT_VALUE_GEQ``): true for up to 2**31 - 1 values past it."""
    return ((int(word) - int(value)) & FLAG_MASK) < 1 << 31


class _Driver:
    """The CUDA driver calls the transport's flags need, through ctypes on ``libcuda.so.1`` (no extra
    dependency): the stream memory operations and host-memory registration. The V2 stream memory
    operations are available by default on every driver since CUDA 11.7, which every supported
    CuPy build needs anyway; `CudaBackend.probe_flags` checks it."""

    WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: cyclic (int32)(*addr - value) >= 0
    WRITE_DEFAULT = 0x0
    HOST_PORTABLE_DEVICEMAP = 0x1 | 0x2  # CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        self._wait = lib.cuStreamWaitValue32_v2
        self._write = lib.cuStreamWriteValue32_v2
        for fn in (self._wait, self._write):
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int
        self._register = lib.cuMemHostRegister_v2
        self._register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._device_pointer = lib.cuMemHostGetDevicePointer_v2
        self._device_pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        self._unregister = lib.cuMemHostUnregister
        self._unregister.argtypes = [ctypes.c_void_p]
        for fn in (self._register, self._device_pointer, self._unregister):
            fn.restype = ctypes.c_int
        self._name = lib.cuGetErrorName
        self._name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    def check(self, result: int, call: str) -> None:
        if result:
            name = ctypes.c_char_p()
            self._name(result, ctypes.byref(name))
            raise RuntimeError(f"{call} failed: {(name.value or b'?').decode()} ({result})")

    def wait(self, stream: int, ptr: int, value: int) -> None:
        self.check(self._wait(stream, ptr, value & FLAG_MASK, self.WAIT_GEQ), "cuStreamWaitValue32_v2")

    def write(self, stream: int, ptr: int, value: int) -> None:
        self.check(self._write(stream, ptr, value & FLAG_MASK, self.WRITE_DEFAULT), "cuStreamWriteValue32_v2")

    def register(self, ptr: int, nbytes: int) -> int:
        self.check(self._register(ptr, nbytes, self.HOST_PORTABLE_DEVICEMAP), "cuMemHostRegister_v2")
        device = ctypes.c_uint64()
        self.check(self._device_pointer(ctypes.byref(device), ptr, 0), "cuMemHostGetDevicePointer_v2")
        return int(device.value)

    def unregister(self, ptr: int) -> None:
        self.check(self._unregister(ptr), "cuMemHostUnregister")


class _TypedDriver:
    """The same calls as `_Driver` through NVIDIA's typed bindings (``cuda.bindings.driver``, the
    ``cuda-bindings`` package of the ``gpu`` extras), which find each entry point of the installed
    driver themselves (no versioned symbol names here) and check argument types. ``driver``: that
    module (a test passes a stand-in). Each call returns ``(CUresult, *values)``."""

    def __init__(self, driver):
        self._cu = driver
        self.WAIT_GEQ = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        self.WRITE_DEFAULT = driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
        self.HOST_PORTABLE_DEVICEMAP = (int(driver.CU_MEMHOSTREGISTER_PORTABLE)
                                        | int(driver.CU_MEMHOSTREGISTER_DEVICEMAP))

    def _call(self, name: str, *args) -> list:
        result, *values = getattr(self._cu, name)(*args)
        if result != self._cu.CUresult.CUDA_SUCCESS:
            _, text = self._cu.cuGetErrorName(result)
            raise RuntimeError(f"{name} failed: {(text or b'?').decode()} ({int(result)})")
        return values

    def wait(self, stream: int, ptr: int, value: int) -> None:
        self._call("cuStreamWaitValue32", self._cu.CUstream(stream), self._cu.CUdeviceptr(ptr), value & FLAG_MASK,
                   self.WAIT_GEQ)

    def write(self, stream: int, ptr: int, value: int) -> None:
        self._call("cuStreamWriteValue32", self._cu.CUstream(stream), self._cu.CUdeviceptr(ptr), value & FLAG_MASK,
                   self.WRITE_DEFAULT)

    def register(self, ptr: int, nbytes: int) -> int:
        self._call("cuMemHostRegister", ptr, nbytes, self.HOST_PORTABLE_DEVICEMAP)
        device, = self._call("cuMemHostGetDevicePointer", ptr, 0)
        return int(device)

    def unregister(self, ptr: int) -> None:
        self._call("cuMemHostUnregister", ptr)


def driver_calls() -> _TypedDriver | _Driver:
    """The driver calls of the transport's flags: through ``cuda.bindings`` where it is installed,
    else through ctypes on ``libcuda.so.1``."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return _Driver()
    return _TypedDriver(driver)


class CudaBackend:
    """CUDA runtime calls through CuPy, on ``device`` (a torch CUDA device). ``stream_memops=False``
    makes `probe_flags` refuse the stream memory operations, so that the transport carries its
    flags on the host (the device check runs that fallback on a GPU)."""

    name = "cuda"

    def __init__(self, device: torch.device | int | None = None, stream_memops: bool = True):
        import cupy  # noqa: F401 - fail early and clearly if CuPy is missing
        from cupy.cuda import runtime
        self._rt = runtime
        if device is None:
            device = torch.cuda.current_device()
        self.device = torch.device("cuda", device if isinstance(device, int) else device.index or 0)
        self.index = self.device.index
        self.stream_memops = stream_memops
        self._driver = None

    def bind_thread(self) -> None:
        """Make this backend's device current in the calling thread (the transport's own threads call it first)."""
        self._rt.setDevice(self.index)
        torch.cuda.set_device(self.device)

    @contextlib.contextmanager
    def on_device(self):
        """This backend's device current in the calling thread for the block, the caller's restored
        after (allocations, streams and the driver's host registration use the current device)."""
        before = self._rt.getDevice()
        self._rt.setDevice(self.index)
        try:
            with torch.cuda.device(self.device):
                yield
        finally:
            self._rt.setDevice(before)

    # memory
    def malloc(self, nbytes: int) -> int:
        return int(self._rt.malloc(max(int(nbytes), 1)))

    def free(self, ptr: int) -> None:
        self._rt.free(ptr)

    def ipc_handle(self, ptr: int) -> bytes:
        return bytes(self._rt.ipcGetMemHandle(ptr))

    def ipc_open(self, handle: bytes) -> int:
        return int(self._rt.ipcOpenMemHandle(bytes(handle), self._rt.cudaIpcMemLazyEnablePeerAccess))

    def ipc_close(self, ptr: int) -> None:
        self._rt.ipcCloseMemHandle(ptr)

    # events and streams
    def event_create(self) -> int:
        """An event without timing on this backend's device; a host thread that synchronises on it
        sleeps (BlockingSync) instead of spinning a core. An event belongs to the device current
        where it is made and is recorded only on that device's streams, and the caller's current
        device need not be ours (a loop that placed the model with ``model.to(local_rank)`` leaves
        torch's at 0)."""
        before = self._rt.getDevice()
        if before != self.index:
            self._rt.setDevice(self.index)
        try:
            return int(self._rt.eventCreateWithFlags(self._rt.eventDisableTiming | self._rt.eventBlockingSync))
        finally:
            if before != self.index:
                self._rt.setDevice(before)

    def event_destroy(self, event: int) -> None:
        self._rt.eventDestroy(event)

    def event_record(self, event: int, stream: int) -> None:
        self._rt.eventRecord(event, stream)

    def event_synchronize(self, event: int) -> None:
        self._rt.eventSynchronize(event)

    def event_query(self, event: int) -> bool:
        """True once the work before the event's last record has run (never blocks)."""
        return self._rt.eventQuery(event) == 0  # cudaSuccess; cudaErrorNotReady (600) while pending

    def stream_create(self) -> int:
        return int(self._rt.streamCreateWithFlags(self._rt.streamNonBlocking))

    def stream_destroy(self, stream: int) -> None:
        self._rt.streamDestroy(stream)

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._rt.streamWaitEvent(stream, event, 0)

    def stream_synchronize(self, stream: int) -> None:
        self._rt.streamSynchronize(stream)

    def current_stream(self) -> int:
        """Torch's current stream on this device, as a raw handle (`kernels.cuda.current_stream_ptr`)."""
        return current_stream_ptr(self.index)

    # flags: 32-bit words waited on and written by a stream (no host thread involved)
    def stream_wait_value32(self, stream: int, ptr: int, value: int) -> None:
        """``stream`` waits until the flag at device address ``ptr`` (this device's memory, or host
        memory from `register_host`) reached ``value`` (`flag_reached`)."""
        self._flags().wait(stream, ptr, value)

    def stream_write_value32(self, stream: int, ptr: int, value: int) -> None:
        """``stream`` writes ``value`` to the flag at ``ptr`` once its earlier work ran, after a
        fence of that work's writes (this device's memory or host memory from `register_host`;
        since CUDA 13.1 a write-value no longer reaches another GPU's memory)."""
        self._flags().write(stream, ptr, value)

    def register_host(self, ptr: int, nbytes: int) -> int:
        """Page-lock host memory at ``ptr`` (a shared-memory mapping) for the device; returns the
        device address of ``ptr``, which copies and stream waits take."""
        return self._flags().register(ptr, nbytes)

    def unregister_host(self, ptr: int) -> None:
        self._flags().unregister(ptr)

    def _flags(self) -> _TypedDriver | _Driver:
        if self._driver is None:
            self._driver = driver_calls()
        return self._driver

    def probe_flags(self) -> str:
        """Why stream flags cannot be used here ("" when they can): a write and a wait on a word of
        device memory and on one of page-locked host memory, as the transport's flags are; through
        ``cuda.bindings`` first, then (where those fail, e.g. bindings for another CUDA major
        version than the driver's) through ctypes."""
        if not self.stream_memops:
            return _memops_off(self)
        reason = self._probe()
        if reason and isinstance(self._driver, _TypedDriver):
            self._driver = _Driver()
            through_ctypes = self._probe()
            reason = f"{reason}; through ctypes: {through_ctypes}" if through_ctypes else ""
        return reason

    def _probe(self) -> str:
        import mmap
        try:
            page = mmap.mmap(-1, mmap.PAGESIZE)
            host = ctypes.addressof(ctypes.c_char.from_buffer(page))
            ptr, stream = self.malloc(4), self.stream_create()
            try:
                mapped = self.register_host(host, mmap.PAGESIZE)
                try:
                    for word in (ptr, mapped):
                        self.stream_write_value32(stream, word, 1)
                        self.stream_wait_value32(stream, word, 1)
                    self.stream_synchronize(stream)
                finally:
                    self.unregister_host(host)
            finally:
                self.stream_destroy(stream)
                self.free(ptr)
        except Exception as exc:  # noqa: BLE001 - every failure is a reason to report
            return f"{type(exc).__name__}: {exc}"
        return ""

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """One ``cudaMemcpyAsync(kind=Default)``: a Copy-Engine copy when dst and src are on different GPUs."""
        if nbytes:
            self._rt.memcpyAsync(dst, src, nbytes, self._rt.memcpyDefault, stream)

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def empty_on(self, stream: int, nbytes: int) -> torch.Tensor:
        """uint8 ``[nbytes]`` from torch's caching allocator as ``stream``'s own: only that stream
        uses it, so it needs to wait for no other stream's work on the memory, and freed, the
        memory goes back to that stream's pool."""
        with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=self.device)):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)


class _HostQueue:
    """A hardware queue of a GPU: one thread runs the operations of the streams mapped onto it, in
    the order they were handed to it, whichever stream they belong to (as CUDA runs the streams it
    maps onto one of its ``CUDA_DEVICE_MAX_CONNECTIONS`` queues: an operation that waits holds up
    the queue's later ones, of every stream)."""

    def __init__(self, name: str):
        self.ops: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()  # a plain lock: cheaper than the default RLock, entered directly (C)
        self.changed = threading.Condition(self.lock)
        self.pending = 0  # operations handed to the thread and not yet run
        self.waiting = 0  # threads in `_HostStream.wait`: only they need a notification
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self.ops.get()
            if item is None:
                return
            stream, op = item
            stream.execute(op)
            with self.lock:
                self.pending -= 1
                stream.ran_locked()

    def stop(self, timeout_s: float) -> bool:
        """Run what is queued, then end the thread; False if it did not end in time."""
        self.ops.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


class _HostStream:
    """A CUDA stream on the host, on a `_HostQueue` (its own, or one it shares with other streams).

    ``queued`` counts the operations handed to it, ``done`` those that ran; an event recorded on
    it is complete once ``done`` reaches ``queued`` at the time of the record. As an idle GPU
    stream starts an operation at once, an operation handed to a stream whose queue is idle and
    that can run without waiting runs on the caller's thread (no thread wake-up); the rest go to
    the queue's thread, one at a time, in order. An operation that fails makes the stream fail (as
    a CUDA error is sticky): its later ones are skipped, and whoever synchronises gets the error.
    ``jitter``: a function of no argument that an operation handed to the thread calls first (a
    random delay: kernels that take their time), or None.
    """

    def __init__(self, name: str, host_queue: Optional[_HostQueue] = None, jitter=None):
        self.owns_queue = host_queue is None
        self.queue = host_queue or _HostQueue(name)
        self._lock, self._changed = self.queue.lock, self.queue.changed
        self.queued = self.done = 0
        self.error: BaseException | None = None
        self.jitter = jitter

    def submit(self, op, ready=None) -> None:
        """Queue ``op``; ``ready()``: whether it could run now without waiting (None: always)."""
        host_queue = self.queue
        with self._lock:  # queued in call order, whichever thread submits
            self.queued += 1
            if host_queue.pending == 0 and self.jitter is None and (ready is None or ready()):
                # idle: nothing is queued or running; holding the lock keeps it so while ``op`` runs
                self.execute(op)
                self.ran_locked()
                return
            host_queue.pending += 1
            if self.jitter is not None:
                op = _after(self.jitter, op)
            host_queue.ops.put((self, op))

    def execute(self, op) -> None:
        if self.error is None:
            try:
                op()
            except BaseException as exc:  # noqa: BLE001 - kept for whoever synchronises
                self.error = exc

    def ran_locked(self) -> None:
        self.done += 1
        if self.queue.waiting:
            self._changed.notify_all()

    def reached(self, ticket: int) -> bool:
        return self.done >= ticket

    def wait(self, ticket: int, timeout_s: float) -> None:
        if self.done < ticket:
            with self._changed:
                self.queue.waiting += 1
                try:
                    if not self._changed.wait_for(lambda: self.done >= ticket, timeout_s):
                        raise TimeoutError(f"host stream did not reach its operation {ticket} within {timeout_s:g} s")
                finally:
                    self.queue.waiting -= 1
        if self.error is not None:
            raise RuntimeError(f"host stream failed: {self.error}") from self.error

    def stop(self, timeout_s: float) -> bool:
        """Run what is queued (its own queue: then end the thread); False if it did not end in time."""
        if self.owns_queue:
            return self.queue.stop(timeout_s)
        marker = threading.Event()
        self.submit(marker.set)
        return marker.wait(timeout_s)


def _after(first, op):
    def both():
        first()
        op()
    return both


class HostBackend:
    """The same operations on host shared memory (``/dev/shm/feplb-host-*``), streams as threads.

    Every allocation lists its importers' process ids in a small locked header, so `free` refuses
    to release memory that another live process still has open (the rule CUDA leaves undefined;
    as with CUDA, a process that died holds nothing), and
    `live` lists what this process still holds: the tests check the transport's handle lifecycle
    with it. A stream's flag wait that is still unmet after ``wait_timeout_s`` fails the stream
    (on a GPU it would wait forever; a test then fails instead of hanging). ``stream_memops=False``
    stands for a driver without stream memory operations: `probe_flags` says so and the flag
    calls raise, which is how CPU machines test the transport's host-flag fallback.

    For ordering stress: ``executors`` maps the streams onto that many shared queues (threads), as
    CUDA maps streams onto ``CUDA_DEVICE_MAX_CONNECTIONS`` hardware queues (0: a queue per stream);
    ``jitter_s`` delays every stream operation by a random time up to it (seeded by ``seed``), so
    that work finishes in orders a fast path would never show; ``poison_released`` asks the
    transport to fill memory it is done with (ring slots once read, staging buffers once copied
    out) with 0xFF bytes (NaN), so that a read after release shows in the data.

    For timing on CPU: ``copy_gbps`` > 0 makes every copy take ``nbytes / copy_gbps`` (GB/s) on its
    stream before it lands, as a copy engine's bandwidth would (the stream's thread sleeps: no CPU).
    """

    name = "host"
    _HEADER = 64  # bytes before the payload: the importers' pids (int64, 0: free entry)

    def __init__(self, prefix: str = "feplb-host", wait_timeout_s: float = 60.0, stream_memops: bool = True,
                 executors: int = 0, jitter_s: float = 0.0, seed: int = 0, poison_released: bool = False,
                 copy_gbps: float = 0.0):
        self.prefix = prefix
        self.copy_gbps = copy_gbps
        self.wait_timeout_s = wait_timeout_s
        self.stream_memops = stream_memops
        self.poison_released = poison_released
        self._queues: list[Optional[_HostQueue]] = [None] * executors  # shared queues, each while a stream uses it
        self._jitter_s, self._seed = jitter_s, seed
        self.device = torch.device("cpu")
        self._owned: dict[int, tuple] = {}  # ptr -> (shm, view)
        self._opened: dict[int, tuple] = {}
        self._events: dict[int, tuple] = {}  # event -> (stream, ticket) of its last record; (None, 0): complete
        self._streams: dict[int, _HostStream] = {}
        self._flag_words: dict[int, ctypes.c_uint32] = {}
        self._next = 1
        self._lock = threading.Lock()
        self._importer_lock = threading.Lock()  # `lockf` excludes other processes, not this one's threads
        self.caller_stream = 0  # `current_stream`

    def bind_thread(self) -> None:
        pass

    def on_device(self):
        return contextlib.nullcontext()

    # memory
    def _map(self, shm):
        view = np.frombuffer(shm.buf, dtype=np.uint8)
        return view, int(view.ctypes.data) + self._HEADER

    def _importers(self, shm, change: int = 0) -> int:
        """Add (``change`` 1) or remove (-1) this process as an importer of ``shm``; returns how many
        live processes import it."""
        from deepspeed_feplb.segments import process_alive
        with self._importer_lock, open(os.path.join("/dev/shm", shm.name), "r+b") as f:
            fcntl.lockf(f, fcntl.LOCK_EX)  # other processes; the lock above: this one's threads
            pids = np.ndarray((self._HEADER // 8, ), dtype=np.int64, buffer=shm.buf)
            if change > 0:  # a free entry, or one of a process that died
                free = [i for i, pid in enumerate(pids.tolist()) if not pid or not process_alive(pid)]
                if not free:
                    raise RuntimeError(f"{shm.name} has {len(pids)} live importers already")
                pids[free[0]] = os.getpid()
            elif change < 0:
                at = np.flatnonzero(pids == os.getpid())
                if len(at):
                    pids[at[0]] = 0
            live = sum(process_alive(int(pid)) for pid in pids if pid)
            del pids
            return live  # closing the file drops the lockf lock

    def malloc(self, nbytes: int) -> int:
        from deepspeed_feplb.segments import open_segment
        shm = open_segment(f"{self.prefix}-{os.getpid()}-{secrets.token_hex(4)}", self._HEADER + max(int(nbytes), 1),
                           create=True)
        view, ptr = self._map(shm)
        view[:self._HEADER] = 0
        with self._lock:
            self._owned[ptr] = (shm, view)
        return ptr

    def free(self, ptr: int) -> None:
        from deepspeed_feplb.segments import unlink_quietly
        with self._lock:
            shm, view = self._owned[ptr]
            importers = self._importers(shm)
            if importers:
                raise RuntimeError(f"free of {shm.name} while {importers} importer(s) still have it open")
            del self._owned[ptr]
        del view
        shm.close()
        unlink_quietly(shm)

    def ipc_handle(self, ptr: int) -> bytes:
        name = self._owned[ptr][0].name.encode()
        if len(name) > HANDLE_BYTES:
            raise ValueError(f"segment name {name!r} longer than a handle")
        return name.ljust(HANDLE_BYTES, b"\0")

    def ipc_open(self, handle: bytes) -> int:
        from deepspeed_feplb.segments import open_segment
        name = bytes(handle).rstrip(b"\0").decode()
        if any(shm.name == name for shm, _ in self._owned.values()):
            raise RuntimeError("a process cannot open its own IPC handle (as with CUDA)")
        shm = open_segment(name)
        self._importers(shm, +1)
        view, ptr = self._map(shm)
        with self._lock:
            self._opened[ptr] = (shm, view)
        return ptr

    def ipc_close(self, ptr: int) -> None:
        with self._lock:
            shm, view = self._opened.pop(ptr)
        del view
        self._importers(shm, -1)
        shm.close()

    # events and streams: stream 0 is the calling thread; others run on their own thread
    def _new_id(self) -> int:
        with self._lock:
            value, self._next = self._next, self._next + 1
        return value

    def event_create(self) -> int:
        event = self._new_id()
        self._events[event] = (None, 0)
        return event

    def event_destroy(self, event: int) -> None:
        del self._events[event]

    def event_record(self, event: int, stream: int) -> None:
        if event not in self._events:
            raise ValueError(f"record of unknown event {event}")
        host = self._stream(stream)
        self._events[event] = (None, 0) if host is None else (host, host.queued)

    def _event_done(self, event: int) -> tuple:
        if event not in self._events:
            raise ValueError(f"unknown event {event}")
        return self._events[event]

    def event_synchronize(self, event: int) -> None:
        host, ticket = self._event_done(event)
        if host is not None:
            host.wait(ticket, self.wait_timeout_s)

    def event_query(self, event: int) -> bool:
        """True once the work before the event's last record has run (never blocks); raises once
        that stream failed (as a sticky CUDA error does)."""
        host, ticket = self._event_done(event)
        if host is None:
            return True
        if host.error is not None:
            raise RuntimeError(f"host stream failed: {host.error}") from host.error
        return host.reached(ticket)

    def stream_create(self) -> int:
        stream = self._new_id()
        jitter = None
        if self._jitter_s > 0:
            rng, most = random.Random(self._seed * 7919 + stream), self._jitter_s
            jitter = lambda: time.sleep(rng.uniform(0.0, most))  # noqa: E731 - one draw per operation
        shared = None
        if self._queues:
            i = stream % len(self._queues)
            shared = self._queues[i] = self._queues[i] or _HostQueue(f"feplb-host-queue-{i}")
        self._streams[stream] = _HostStream(f"feplb-host-stream-{stream}", shared, jitter)
        return stream

    def stream_destroy(self, stream: int) -> None:
        host = self._streams.pop(stream)
        if not host.stop(self.wait_timeout_s):
            raise RuntimeError(f"host stream {stream} still runs an operation; its thread is left behind")
        if not host.owns_queue and all(other.queue is not host.queue for other in self._streams.values()):
            self._queues[self._queues.index(host.queue)] = None  # the last stream of a shared queue: its thread ends
            host.queue.stop(self.wait_timeout_s)

    def memset_async(self, ptr: int, byte: int, nbytes: int, stream: int) -> None:
        if nbytes:
            self._on(stream, functools.partial(ctypes.memset, ptr, byte, nbytes))

    def _stream(self, stream: int):
        if not stream:
            return None
        host = self._streams.get(stream)
        if host is None:
            raise ValueError(f"unknown stream {stream}")
        return host

    def _on(self, stream: int, op, ready=None) -> None:
        """Run ``op`` on ``stream``: now on stream 0, else after what is queued there (``ready``:
        `_HostStream.submit`)."""
        host = self._stream(stream)
        if host is None:
            op()
        else:
            host.submit(op, ready)

    def stream_wait_event(self, stream: int, event: int) -> None:
        host, ticket = self._event_done(event)  # the record as of now, as CUDA does
        if host is not None and not (host.reached(ticket) and host.error is None):  # else: met already
            self._on(stream, lambda: host.wait(ticket, self.wait_timeout_s), lambda: host.reached(ticket))

    def stream_synchronize(self, stream: int) -> None:
        host = self._stream(stream)
        if host is not None:
            host.wait(host.queued, self.wait_timeout_s)

    def current_stream(self) -> int:
        """`caller_stream`: 0, the calling thread (what it queues runs at once), unless a test made
        the caller's a stream of its own, to emulate a compute stream with work queued (`delay`)."""
        return self.caller_stream

    def delay(self, stream: int, seconds: float) -> None:
        """Queue ``seconds`` of work on ``stream`` (an emulated kernel: the stream's thread sleeps;
        the caller goes on, as after a kernel launch)."""
        self._on(stream, functools.partial(time.sleep, seconds), ready=lambda: False)

    def _check_memops(self, call: str) -> None:
        if not self.stream_memops:
            raise RuntimeError(f"{call}: {_memops_off(self)}")

    def _flag_word(self, ptr: int) -> ctypes.c_uint32:
        """The 32-bit word at ``ptr``, made once per address (a transport signals the same few)."""
        word = self._flag_words.get(ptr)
        if word is None:
            word = self._flag_words[ptr] = ctypes.c_uint32.from_address(ptr)
        return word

    def stream_wait_value32(self, stream: int, ptr: int, value: int) -> None:
        self._check_memops("cuStreamWaitValue32_v2")
        word = self._flag_word(ptr)
        if flag_reached(word.value, value):
            return  # met already: flags only move on, so the stream would pass it at once

        def wait() -> None:
            deadline, pause = time.monotonic() + self.wait_timeout_s, 1e-5
            while not flag_reached(word.value, value):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"flag at {ptr:#x} is {word.value:#x} after {self.wait_timeout_s:g} s; "
                                       f"waited for {value & FLAG_MASK:#x}")
                time.sleep(pause)
                pause = min(2 * pause, 1e-3)
        self._on(stream, wait, lambda: flag_reached(word.value, value))

    def stream_write_value32(self, stream: int, ptr: int, value: int) -> None:
        self._check_memops("cuStreamWriteValue32_v2")
        self._on(stream, functools.partial(setattr, self._flag_word(ptr), "value", value & FLAG_MASK))

    def probe_flags(self) -> str:
        return "" if self.stream_memops else _memops_off(self)

    def register_host(self, ptr: int, nbytes: int) -> int:
        """Host memory is the device's: its address is its own."""
        self._check_memops("cuMemHostRegister_v2")
        return ptr

    def unregister_host(self, ptr: int) -> None:
        pass

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        if nbytes:
            op = functools.partial(ctypes.memmove, dst, src, nbytes)
            if self.copy_gbps > 0:
                op = _after(functools.partial(time.sleep, nbytes / (self.copy_gbps * 1e9)), op)
            self._on(stream, op)

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def empty_on(self, stream: int, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def live(self) -> dict:
        """What this process still holds: owned and opened segments, events, streams."""
        return {"owned": [s.name for s, _ in self._owned.values()],
                "opened": [s.name for s, _ in self._opened.values()],
                "events": len(self._events), "streams": len(self._streams)}
