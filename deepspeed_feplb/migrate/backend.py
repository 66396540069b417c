"""The device operations the Copy-Engine transport uses, behind one small interface.

`CudaBackend` maps them one to one onto CUDA runtime calls through CuPy (plain ``cudaMalloc``,
legacy IPC memory and event handles, ``cudaMemcpyAsync`` with ``cudaMemcpyDefault`` on
non-blocking streams; docs/GPU.md). `HostBackend` implements the *same*
semantics on host shared memory, synchronously (a stream is the calling thread, an event is
always complete, an IPC handle names a ``/dev/shm`` segment). The transport's protocol (slots,
handles, generations, ordering, teardown) is therefore exercised on CPU machines with the same
code that drives the GPU; only the CUDA calls themselves differ.

Pointers, streams and events are plain ints. Handles are 64 bytes, as CUDA's are.
"""
from __future__ import annotations

import ctypes
import fcntl
import os
import secrets
import threading

import numpy as np
import torch

HANDLE_BYTES = 64


class CudaBackend:
    """CUDA runtime calls through CuPy, on ``device`` (a torch CUDA device)."""

    name = "cuda"

    def __init__(self, device: torch.device | int | None = None):
        import cupy  # noqa: F401 - fail early and clearly if CuPy is missing
        from cupy.cuda import runtime
        self._rt = runtime
        if device is None:
            device = torch.cuda.current_device()
        self.device = torch.device("cuda", device if isinstance(device, int) else device.index or 0)
        self.index = self.device.index

    def bind_thread(self) -> None:
        """Make this backend's device current in the calling thread (copy threads call it first)."""
        self._rt.setDevice(self.index)
        torch.cuda.set_device(self.device)

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
    def event_create(self, interprocess: bool = False) -> int:
        """An event without timing; a host thread that synchronises on it sleeps (BlockingSync)
        instead of spinning a core."""
        flags = self._rt.eventDisableTiming | self._rt.eventBlockingSync
        if interprocess:
            flags |= self._rt.eventInterprocess
        return int(self._rt.eventCreateWithFlags(flags))

    def event_destroy(self, event: int) -> None:
        self._rt.eventDestroy(event)

    def event_handle(self, event: int) -> bytes:
        return bytes(self._rt.ipcGetEventHandle(event))

    def event_open(self, handle: bytes) -> int:
        return int(self._rt.ipcOpenEventHandle(bytes(handle)))

    def event_close(self, event: int) -> None:
        self._rt.eventDestroy(event)  # an opened IPC event is released like a local one

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

    def current_stream(self) -> int:
        return int(torch.cuda.current_stream(self.device).cuda_stream)

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """One ``cudaMemcpyAsync(kind=Default)``: a Copy-Engine copy when dst and src are on different GPUs."""
        if nbytes:
            self._rt.memcpyAsync(dst, src, nbytes, self._rt.memcpyDefault, stream)

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)


class HostBackend:
    """The same operations on host shared memory (``/dev/shm/feplb-host-*``), executed synchronously.

    Every allocation carries an importer count in a small locked header, so `free` refuses to
    release memory that another process still has open (the rule CUDA leaves undefined), and
    `live` lists what this process still holds: the tests check the transport's handle lifecycle
    with it.
    """

    name = "host"
    _HEADER = 64  # bytes before the payload: int64 importer count

    def __init__(self, prefix: str = "feplb-host"):
        self.prefix = prefix
        self.device = torch.device("cpu")
        self._owned: dict[int, tuple] = {}  # ptr -> (shm, view)
        self._opened: dict[int, tuple] = {}
        self._events: set[int] = set()
        self._streams: set[int] = set()
        self._next = 1
        self._lock = threading.Lock()

    def bind_thread(self) -> None:
        pass

    # memory
    def _map(self, shm):
        view = np.frombuffer(shm.buf, dtype=np.uint8)
        return view, int(view.ctypes.data) + self._HEADER

    def _count(self, shm, delta: int) -> int:
        fd = os.open(os.path.join("/dev/shm", shm.name), os.O_RDWR)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
            counter = np.ndarray((1, ), dtype=np.int64, buffer=shm.buf)
            counter[0] += delta
            value = int(counter[0])
            del counter
            fcntl.lockf(fd, fcntl.LOCK_UN)
            return value
        finally:
            os.close(fd)

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
            importers = self._count(shm, 0)
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
        shm = open_segment(bytes(handle).rstrip(b"\0").decode())
        self._count(shm, +1)
        view, ptr = self._map(shm)
        with self._lock:
            if ptr in self._owned:
                raise RuntimeError("a process cannot open its own IPC handle (as with CUDA)")
            self._opened[ptr] = (shm, view)
        return ptr

    def ipc_close(self, ptr: int) -> None:
        with self._lock:
            shm, view = self._opened.pop(ptr)
        del view
        self._count(shm, -1)
        shm.close()

    # events and streams: the host executes in order, so an event is complete when recorded
    def _new(self, bag: set) -> int:
        with self._lock:
            value, self._next = self._next, self._next + 1
            bag.add(value)
        return value

    def event_create(self, interprocess: bool = False) -> int:
        return self._new(self._events)

    def event_destroy(self, event: int) -> None:
        self._events.remove(event)

    def event_handle(self, event: int) -> bytes:
        if event not in self._events:
            raise ValueError(f"unknown event {event}")
        return f"host-event-{os.getpid()}-{event}".encode().ljust(HANDLE_BYTES, b"\0")

    def event_open(self, handle: bytes) -> int:
        if not bytes(handle).startswith(b"host-event-"):
            raise ValueError(f"not an event handle: {bytes(handle)!r}")
        return self._new(self._events)

    def event_close(self, event: int) -> None:
        self._events.remove(event)

    def event_record(self, event: int, stream: int) -> None:
        if event not in self._events or (stream and stream not in self._streams):
            raise ValueError(f"record of unknown event {event} / stream {stream}")

    def event_synchronize(self, event: int) -> None:
        if event not in self._events:
            raise ValueError(f"unknown event {event}")

    def event_query(self, event: int) -> bool:
        self.event_synchronize(event)
        return True

    def stream_create(self) -> int:
        return self._new(self._streams)

    def stream_destroy(self, stream: int) -> None:
        self._streams.remove(stream)

    def stream_wait_event(self, stream: int, event: int) -> None:
        self.event_record(event, stream)

    def current_stream(self) -> int:
        return 0

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        if nbytes:
            ctypes.memmove(dst, src, nbytes)

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def live(self) -> dict:
        """What this process still holds: owned and opened segments, events, streams."""
        return {"owned": [s.name for s, _ in self._owned.values()],
                "opened": [s.name for s, _ in self._opened.values()],
                "events": len(self._events), "streams": len(self._streams)}
