"""Host reads of device-side results, found on the CPU (`audit_syncs`).

On a GPU, a host read of a tensor that the device computes (``.item()``, ``.tolist()``, ``.cpu()``,
``bool(t)``, an op whose output size depends on values: ``nonzero``, ``masked_select``, ...) waits
for every kernel queued before it: a device-to-host synchronisation. On the CPU the same code runs
the same operators, and which tensors would live on the device is known by where they come from:
the audit marks the tensors given to it (a layer's input, its parameters) as device-side, then
every result of an operator with a device-side input, and of a collective whose input is; a host
read of a marked tensor is a sync (``.item()``, ``bool()``, ``.tolist()``, ``.numpy()``, ``.cpu()``, and
value-dependent operators), except where only the CPU kernel reads (``one_hot`` with ``num_classes``
checks its indices on the host on the CPU, not on CUDA). A ``.to("cpu")`` is not counted (on the
CPU it cannot be told from a ``.to(x.device)``); a host read of its result is.

An upload of host data to the device (``t.to(x.device)`` of a host tensor, ``torch.tensor(data,
device=...)``, ``torch.as_tensor(data, device=...)``) without ``non_blocking=True`` is counted too: on
a GPU a blocking copy from host memory synchronises the stream. The device is told from a
``torch.device`` (``x.device``, ``self.device``) or a device-side tensor given as the target; a
string such as ``"cpu"`` is the host's. The uploaded tensor is device-side from then on.

What it cannot see: a tensor the code creates on the device from nothing (``torch.zeros(n,
device=x.device)``) is not marked until a marked tensor flows into it, so reading it back is
missed; such reads are rare (the code made the values), and a GPU's own audit
(``torch.cuda.set_sync_debug_mode``, the device check's ``syncs`` stage) sees them.
"""
from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# operators that read device values on the host: a scalar, or an output size that depends on values
_READS = {"_local_scalar_dense", "nonzero", "masked_select", "unique_dim", "_unique", "_unique2",
          "unique_consecutive", "equal", "is_nonzero", "bincount", "histc"}
_COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_single", "all_to_all_single", "all_reduce",
                "broadcast", "reduce_scatter_tensor")


@dataclass
class SyncAudit:
    """``reads``: one entry per host read of a device-side tensor, "what at where" (the innermost
    frames of DeepSpeed or FEPLB, or of the caller's code, that asked); ``feplb_reads``: those
    asked by FEPLB's code (the innermost frame of DeepSpeed or FEPLB is FEPLB's), not by the model
    or DeepSpeed around it."""
    reads: list = field(default_factory=list)
    feplb_reads: list = field(default_factory=list)
    device_side: Callable[..., None] = lambda *tensors: None  # mark more tensors as the device's (`audit_syncs`)

    @property
    def count(self) -> int:
        return len(self.reads)


class _Marks(TorchDispatchMode):
    def __init__(self, audit: SyncAudit, tensors):
        super().__init__()
        self.audit = audit
        self.quiet = 0  # inside an operator whose host reads are the CPU kernel's own (`audit_syncs`)
        self.marked: dict[int, torch.Tensor] = {}  # id -> tensor (kept alive so that ids stay unique)
        for t in tensors:
            self.mark(t)

    def mark(self, t) -> None:
        if isinstance(t, torch.Tensor):
            self.marked[id(t)] = t

    def is_marked(self, t) -> bool:
        return isinstance(t, torch.Tensor) and (id(t) in self.marked or (t._base is not None and id(t._base)
                                                                          in self.marked))

    def read(self, what: str) -> None:
        if self.quiet:
            return
        frames = [f for f in traceback.extract_stack()[:-2] if "testing/sync_audit" not in f.filename
                  and "/torch/" not in f.filename and "contextlib" not in f.filename]
        ours = [f for f in frames if "deepspeed" in f.filename] or frames
        where = " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in reversed(ours[-2:]))
        self.audit.reads.append(f"{what} at {where}")
        innermost = next((f for f in reversed(frames) if "deepspeed" in f.filename), None)
        if innermost is not None and "deepspeed_feplb" in innermost.filename and "testing" not in innermost.filename:
            self.audit.feplb_reads.append(self.audit.reads[-1])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs, _ = tree_flatten((args, kwargs))
        device_side = any(self.is_marked(t) for t in inputs)
        name = func._overloadpacket.__name__
        if device_side and name in _READS:
            self.read(name)
        if device_side and name == "repeat_interleave" and kwargs.get("output_size") is None:
            self.read("repeat_interleave without output_size")
        if name in ("index", "index_put", "index_put_") and any(  # a boolean mask: its true count
                isinstance(i, torch.Tensor) and i.dtype == torch.bool and self.is_marked(i)
                for i in tree_flatten(args[1] if len(args) > 1 else ())[0]):
            self.read(f"{name} with a boolean mask")
        out = func(*args, **kwargs)
        if device_side:
            for t in tree_flatten(out)[0]:
                self.mark(t)
            for i, argument in enumerate(func._schema.arguments):  # in-place and out= writes
                if argument.alias_info is not None and argument.alias_info.is_write:
                    target = args[i] if i < len(args) else kwargs.get(argument.name)
                    for t in tree_flatten(target)[0]:
                        self.mark(t)
        return out


class _Uploads(TorchFunctionMode):
    """Host data moved to the device (module docstring): the result is device-side, and without
    ``non_blocking=True`` the copy is a sync."""

    def __init__(self, marks: _Marks):
        super().__init__()
        self.marks = marks

    def _target(self, func, args, kwargs):
        """What ``func`` uploads, as (how, blocking), or None: not an upload of host data."""
        if func is torch.Tensor.to and args and isinstance(args[0], torch.Tensor) and not self.marks.is_marked(args[0]):
            device = kwargs.get("device", args[1] if len(args) > 1 else None)
            to_device = isinstance(device, torch.device) or (isinstance(device, torch.Tensor)
                                                              and self.marks.is_marked(device))
            blocking = not (kwargs.get("non_blocking") or any(a is True for a in args[1:]))
            return (".to(device)", blocking) if to_device else None
        if func in (torch.tensor, torch.as_tensor) and isinstance(kwargs.get("device"), torch.device):
            data = args[0] if args else kwargs.get("data")
            if not self.marks.is_marked(data):
                return f"torch.{func.__name__}(..., device=)", True
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        upload = self._target(func, args, kwargs)
        out = func(*args, **kwargs)
        if upload is not None:
            self.marks.mark(out)
            if upload[1]:
                self.marks.read(f"blocking upload {upload[0]}")
        return out


@contextlib.contextmanager
def audit_syncs(*device_tensors):
    """``with audit_syncs(x, *params) as audit:`` the host reads of device-side tensors inside the
    block (forward, and backward when it runs inside), ``device_tensors`` and what is computed from
    them being device-side (module docstring); ``audit.device_side(t, ...)`` marks more (a tensor a
    framework built from host values on the device). Yields a `SyncAudit`, filled as the block runs."""
    audit = SyncAudit()
    marks = _Marks(audit, [t for t in device_tensors if isinstance(t, torch.Tensor)])
    audit.device_side = lambda *tensors: [marks.mark(t) for t in tensors] and None
    saved_methods = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "cpu")}
    one_hot = torch.nn.functional.one_hot
    saved_collectives = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def host_copy(name):
        original = saved_methods[name]

        def method(self, *args, **kwargs):
            if not marks.is_marked(self):
                return original(self, *args, **kwargs)
            marks.read(f".{name}()")
            # the host's copy (a GPU's .cpu() copies): not device-side; and not this method again
            # through the upload mode, which hands torch functions back by their public name
            with torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction():
                return original(self.clone() if name == "cpu" else self, *args, **kwargs)
        return method

    def quiet_one_hot(tensor, num_classes=-1):
        """CPU's one_hot checks the indices' range on the host; CUDA's does not when given
        ``num_classes`` (a device assert instead): not a sync there."""
        if num_classes < 0:
            return one_hot(tensor, num_classes)
        marks.quiet += 1
        try:
            return one_hot(tensor, num_classes)
        finally:
            marks.quiet -= 1

    def collective(name):
        original = saved_collectives[name]

        def call(*args, **kwargs):
            result = original(*args, **kwargs)
            tensors = tree_flatten((args, kwargs))[0]
            if any(marks.is_marked(t) for t in tensors):
                for t in tensors:
                    marks.mark(t)
            return result
        return call

    for name in saved_methods:
        setattr(torch.Tensor, name, host_copy(name))
    torch.nn.functional.one_hot = quiet_one_hot
    for name in saved_collectives:
        setattr(dist, name, collective(name))
    try:
        with marks, _Uploads(marks):
            yield audit
    finally:
        for name, method in saved_methods.items():
            setattr(torch.Tensor, name, method)
        torch.nn.functional.one_hot = one_hot
        for name, fn in saved_collectives.items():
            setattr(dist, name, fn)
