"""Defects a review of the GPU path found before it ever ran on a GPU, each pinned on CPU.

DeepEP's synchronous events, where the DeepEP adapter is selected, CuPy's default -ftz=true,
row sizes of empty sources, a combine over k = 0 routes, arenas freed under live views, and sent
tensors released before their copies ran.
"""
import gc
import secrets
import sys
import types
import warnings

import pytest
import torch

from deepspeed_feplb.config import FEPLBConfigError, load_config


# ------------------------------------------------------------------ 1. DeepEP's EventOverlap
def test_reference_events_behave_like_deepeps():
    """DeepEP returns EventOverlap(None) from synchronous calls; its current_stream_wait() asserts."""
    from deepspeed_feplb.dispatch.deepep import ReferenceBuffer
    buffer = ReferenceBuffer(None)
    ids = torch.tensor([[0, 1], [1, -1]])
    *_, sync_event = buffer.get_dispatch_layout(ids, 2)
    with pytest.raises(AssertionError):
        sync_event.current_stream_wait()
    *_, async_event = buffer.get_dispatch_layout(ids, 2, async_finish=True)
    async_event.current_stream_wait()


def test_the_adapter_never_waits_on_a_synchronous_event():
    """Single rank, the whole adapter path (layout, dispatch, combine, backward) on the reference."""
    from deepspeed_feplb.dispatch.deepep import DeepEPDispatcher, ReferenceBuffer
    from deepspeed_feplb.dispatch.torch_a2a import TorchDispatcher
    x = torch.randn(5, 8, requires_grad=True)
    ids = torch.tensor([[0, 1, 2, 0, 1], [2, 0, -1, 1, 2]])
    gates = torch.rand(2, 5)
    ours = DeepEPDispatcher(None, 1, 3, buffer=ReferenceBuffer(None))
    rows, counts, handle, _ = ours.dispatch(x, ids)
    out = ours.combine(rows * 2, gates, handle)
    ref_rows, ref_counts, ref_handle, _ = TorchDispatcher(None, 1, 3).dispatch(x, ids)
    assert torch.equal(rows, ref_rows) and (counts == ref_counts).all()
    out.sum().backward()
    assert torch.allclose(out, TorchDispatcher(None, 1, 3).combine(ref_rows * 2, gates, ref_handle))
    assert x.grad is not None


# ------------------------------------------------------------------ 2. where DeepEP is selected
def test_deepep_is_only_offered_where_the_adapter_works():
    """Within a host DeepEP's intranode kernels (EP 2, 4, 8); across hosts of 8 GPUs its internode
    kernels (EP 16 ... 160) where the installed deep_ep has them (built with NVSHMEM)."""
    from deepspeed_feplb.dispatch import deepep_unsupported
    has_internode, lacks_it = (lambda: None), (lambda: "the installed deep_ep has no internode kernels")
    assert deepep_unsupported(8, 4096, 8) is None
    assert "EP sizes" in deepep_unsupported(16, 4096, 16)
    assert "spans hosts of 4 ranks" in deepep_unsupported(8, 4096, 4)
    assert "multiple of 16 bytes" in deepep_unsupported(8, 100, 8)
    for ep in (16, 32, 64, 128):
        assert deepep_unsupported(ep, 4096, 8, has_internode) is None
        assert deepep_unsupported(ep, 4096, 8, lacks_it) == "the installed deep_ep has no internode kernels"
    assert "across hosts, not 24" in deepep_unsupported(24, 4096, 8, has_internode)
    assert "take hosts of 8 GPUs" in deepep_unsupported(16, 4096, 4, has_internode)
    assert "multiple of 16 bytes" in deepep_unsupported(16, 100, 8, has_internode)
    # DeepEP takes each 8 ranks of the group, in order, as one host
    assert deepep_unsupported(16, 4096, 8, has_internode, group_ranks=range(16, 32)) is None
    strided = list(range(0, 64, 4))  # a group taking every 4th rank: its first 8 lie on 4 hosts
    assert "ranks [0, 4, 8, 12, 16, 20, 24, 28] are one host to DeepEP's internode kernels" in \
        deepep_unsupported(16, 4096, 8, has_internode, group_ranks=strided)


@pytest.fixture
def deepep_present(monkeypatch):
    """As on a GPU host with deep_ep: bf16 CUDA experts, DeepEP importable (nothing is created)."""
    import deepspeed_feplb.dispatch as dispatch
    monkeypatch.setattr(dispatch, "deepep_available", lambda: True)
    monkeypatch.setattr(dispatch, "_on_cuda_bf16", lambda params: (True, True))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    from deepspeed_feplb import once
    monkeypatch.setattr(once, "_said", set())
    return dispatch


def test_explicit_deepep_for_an_unsupported_group_is_a_config_error(deepep_present):
    config = load_config({"feplb": {"ep_backend": "deepep"}})
    with pytest.raises(FEPLBConfigError, match=r'feplb.ep_backend: "deepep": .*EP sizes'):
        deepep_present.make_dispatcher(config, None, 12, 4, [], hidden=4096)
    with pytest.raises(FEPLBConfigError, match="multiple of 16 bytes"):
        deepep_present.make_dispatcher(config, None, 8, 4, [], hidden=100)
    from deepspeed_feplb.dispatch.deepep import DeepEPDispatcher
    assert isinstance(deepep_present.make_dispatcher(config, None, 8, 4, [], hidden=4096), DeepEPDispatcher)


def test_auto_falls_back_to_torch_with_one_warning(deepep_present):
    from deepspeed_feplb.dispatch.deepep import DeepEPDispatcher
    from deepspeed_feplb.dispatch.torch_a2a import TorchDispatcher
    config = load_config({"feplb": {}})
    with pytest.warns(RuntimeWarning, match="not using DeepEP"):
        assert isinstance(deepep_present.make_dispatcher(config, None, 12, 4, [], hidden=4096), TorchDispatcher)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same reason is said once
        assert isinstance(deepep_present.make_dispatcher(config, None, 12, 4, [], hidden=4096), TorchDispatcher)
    assert isinstance(deepep_present.make_dispatcher(config, None, 8, 4, [], hidden=4096), DeepEPDispatcher)


def test_auto_takes_deepeps_internode_kernels_across_hosts_where_deep_ep_has_them(deepep_present, monkeypatch):
    """EP 16 over hosts of 8: DeepEP where the installed deep_ep was built with NVSHMEM, else torch's
    all-to-all with the reason said once; "deepep" chosen explicitly refuses with it."""
    from deepspeed_feplb.dispatch import deepep
    from deepspeed_feplb.dispatch.torch_a2a import TorchDispatcher
    config = load_config({"feplb": {}})
    monkeypatch.setattr(deepep, "internode_missing", lambda: None)
    assert isinstance(deepep_present.make_dispatcher(config, None, 16, 4, [], hidden=4096), deepep.DeepEPDispatcher)
    monkeypatch.setattr(deepep, "internode_missing", lambda: "the installed deep_ep has no internode kernels")
    with pytest.warns(RuntimeWarning, match="not using DeepEP .the installed deep_ep has no internode kernels"):
        assert isinstance(deepep_present.make_dispatcher(config, None, 16, 4, [], hidden=4096), TorchDispatcher)
    with pytest.raises(FEPLBConfigError, match="no internode kernels"):
        deepep_present.make_dispatcher(load_config({"feplb": {"ep_backend": "deepep"}}), None, 16, 4, [], hidden=4096)


# ------------------------------------------------------------------ 6. no -ftz=true from CuPy
def test_runtime_compile_keeps_subnormals(monkeypatch):
    """The kernels are built with exactly OPTIONS (-ftz=false) through NVRTC, never through a CuPy
    path that appends -ftz=true; a fake CuPy records what the loader asks for."""
    from deepspeed_feplb.kernels import cuda as kernels
    calls = {}

    def compile_using_nvrtc(source, options=(), arch=None, **_):
        calls["options"], calls["arch"] = tuple(options), arch
        return b"cubin", {}

    class Module:
        def load(self, data):
            calls["loaded"] = data

        def get_function(self, name):
            return name

    class Device:
        compute_capability = "90"

        def __init__(self, index):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def raw_module(*args, **kwargs):
        raise AssertionError("cupy.RawModule appends -ftz=true")

    cupy = types.ModuleType("cupy")
    cupy.RawModule = raw_module
    cupy.cuda = types.SimpleNamespace(Device=Device,
                                      compiler=types.SimpleNamespace(compile_using_nvrtc=compile_using_nvrtc),
                                      function=types.SimpleNamespace(Module=Module))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cupy.cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.compiler", cupy.cuda.compiler)
    monkeypatch.setitem(sys.modules, "cupy.cuda.function", cupy.cuda.function)
    monkeypatch.setattr(kernels, "_modules", {})
    functions = kernels._module(0)
    assert "-ftz=false" in calls["options"] and "-ftz=true" not in calls["options"]
    assert calls["arch"] == "90" and calls["loaded"] == b"cubin"
    assert set(kernels.KERNELS) <= set(functions)


# ------------------------------------------------------------------ 7. edge cases
def test_row_bytes_of_an_empty_source_is_its_row_size():
    """A gather from a 0-row source writes zero rows for index -1: the kernel needs the row size."""
    from deepspeed_feplb.kernels.cuda import _row_bytes
    assert _row_bytes(torch.empty(0, 4, 3)) == 48
    assert _row_bytes(torch.empty(7, 5, dtype=torch.bfloat16)) == 10
    from deepspeed_feplb.kernels import reference
    out = reference.gather_rows(torch.empty(0, 4), torch.tensor([-1, -1]))
    assert torch.equal(out, torch.zeros(2, 4))


def test_combine_of_zero_routes_is_zero():
    from deepspeed_feplb.kernels import reference
    out = reference.weighted_combine(torch.randn(3, 4), torch.zeros(5, 0, dtype=torch.long), torch.zeros(5, 0))
    assert torch.equal(out, torch.zeros(5, 4))


def test_an_arena_is_not_freed_under_live_views():
    from deepspeed_feplb.migrate.arena import PeerArena
    from deepspeed_feplb.migrate.backend import HostBackend
    backend = HostBackend(prefix=f"feplb-test-{secrets.token_hex(4)}")
    arena = PeerArena(backend, 1024)
    view = arena.tensor(None, 0, (4, ), torch.int64)
    derived = view[1:]
    del view
    with pytest.raises(RuntimeError, match="still referenced"):
        arena.close()
    del derived
    gc.collect()
    arena.close()
    assert backend.live()["owned"] == []
    with pytest.raises(RuntimeError, match="closed"):
        arena.tensor(None, 0, (4, ), torch.int64)


# ------------------------------------------------------------------ 3. auto budget timed on the device
def test_cuda_compute_is_timed_with_events_read_one_micro_batch_later(monkeypatch):
    """Host time around asynchronous launches measures the launches: on CUDA the static-expert and
    expert times that size ce_budget "auto" come from CUDA events, read once they completed."""
    from deepspeed_feplb.expert_costs import ComputeTimes

    class Event:  # a CUDA event on a fake device timeline: the GPU runs 5 ms behind the host
        now = 0.0

        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at, self.done = None, False

        def record(self, stream=None):
            Event.now += 10.0  # ms of GPU work between two marks
            self.at = Event.now

        def query(self):
            return self.done

        def elapsed_time(self, end):
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7000 + index, raising=False)
    from deepspeed_feplb import expert_costs
    monkeypatch.setattr(expert_costs, "_torch_stream", lambda index, ptr: None)
    times = ComputeTimes()
    mark = times.clock(torch.device("cuda", 0))
    begin, static_done, end = mark(), mark(), mark()
    times.finish(begin, static_done, end, rows=100)
    assert (times.static_seconds, times.expert_seconds) == (0.0, 0.0)  # nothing read yet: the GPU is still busy
    times.clock(torch.device("cuda", 0))
    assert times.pending is not None  # not complete: not read, older figures kept
    for event in times.pending[:3]:
        event.done = True
    times.clock(torch.device("cuda", 0))
    assert times.static_seconds == pytest.approx(0.010) and times.expert_seconds == pytest.approx(0.020)
    cpu = ComputeTimes()
    mark = cpu.clock(torch.device("cpu"))
    begin = mark()
    cpu.finish(begin, begin + 0.5, begin + 2.0, rows=100)
    assert (cpu.static_seconds, cpu.expert_seconds, cpu.rows) == (0.5, 2.0, 100)


# ------------------------------------------------------------------ 5. no host waits on the copy path
def _transport_pair(backend_cls):
    """This rank's `CudaCETransport` of a 2-rank domain over ``backend_cls`` (a `HostBackend`)."""
    import torch.distributed as dist

    from deepspeed_feplb.migrate.cuda_ce import CudaCETransport
    names = [f"feplb-test-{secrets.token_hex(4)}"]
    dist.broadcast_object_list(names, 0)
    backend = backend_cls(prefix=f"{names[0]}-mem")
    rank = dist.get_rank()
    if rank == 0:
        t = CudaCETransport(names[0], 0, 2, 20.0, True, backend=backend, slot_bytes=1 << 14)
    dist.barrier()
    if rank:
        t = CudaCETransport(names[0], 1, 2, 20.0, False, backend=backend, slot_bytes=1 << 14)
    return backend, t
def _exchange_counting_host_waits() -> dict:
    import torch.distributed as dist

    from deepspeed_feplb.migrate.backend import HostBackend

    class Counting(HostBackend):
        """Events recorded in the current round report their work as still running (a busy GPU)."""
        syncs = 0
        recent: set = set()

        def event_synchronize(self, event):
            Counting.syncs += 1
            super().event_synchronize(event)

        def event_record(self, event, stream):
            Counting.recent.add(event)
            super().event_record(event, stream)

        def event_query(self, event):
            return event not in Counting.recent

    rank = dist.get_rank()
    backend, t = _transport_pair(Counting)
    ok, held = True, []
    for r in range(5):
        Counting.recent.clear()
        sent = [torch.full((64, 8), float(r + rank)), torch.arange(3)]
        future = t.send(1 - rank, r, sent)
        got = t.recv(1 - rank, r)
        future.result(timeout=20)
        ok &= torch.equal(got[0], torch.full((64, 8), float(r + 1 - rank)))
        # what the transport still holds: this message's tensors (its copies "still run"), the earlier
        # ones released by this round's calls
        held.append([[x.data_ptr() == y.data_ptr() for x, y in zip(tensors, sent)]
                     for _, tensors in t._in_flight[1 - rank]])
    during = Counting.syncs
    dist.barrier()
    t.close()
    return {"ok": bool(ok), "held": held, "syncs_during": during}


def test_sends_never_wait_for_the_device_and_keep_their_memory():
    """A send's future completes once its copies are queued (no event synchronisation per message,
    which serialised messages and blocked the host), and the transport keeps every sent tensor
    from reuse by the allocator until its copy ran, then lets it go."""
    from deepspeed_feplb.testing import run_distributed
    for result in run_distributed(_exchange_counting_host_waits, 2, timeout=120):
        assert result["ok"]
        assert result["held"] == [[[True, True]]] * 5, "sent tensors are held until their copies ran, then released"
        assert result["syncs_during"] == 0, "a send synchronised on an event per message"


def test_events_let_a_waiting_host_thread_sleep_and_belong_to_the_experts_device():
    """Events sleep a waiting host thread, and are made on the backend's device even where the
    caller's current device is another (``model.to(local_rank)`` leaves torch's at 0; CUDA refuses
    to record an event of device 0 on a stream of device 1), the caller's restored after."""
    from deepspeed_feplb.migrate.backend import CudaBackend
    made, current = [], [0]
    runtime = types.SimpleNamespace(eventDisableTiming=2, eventBlockingSync=1, eventInterprocess=4,
                                    getDevice=lambda: current[0], setDevice=lambda d: current.__setitem__(0, d),
                                    eventCreateWithFlags=lambda f: made.append((f, current[0])) or 7)
    backend = object.__new__(CudaBackend)  # no CuPy here: only the runtime calls are faked
    backend._rt, backend.index = runtime, 1
    assert backend.event_create() == 7
    assert made == [(2 | 1, 1)] and current == [0]
    current[0] = 1  # already current: nothing switched
    backend.event_create()
    assert made[-1] == (2 | 1, 1) and current == [1]


def test_stage_timing_events_go_on_the_experts_devices_stream(monkeypatch):
    """The stage's and the cost fit's timing events record on the experts' device's current stream,
    not on that of torch's current device, which may be idle."""
    import torch

    from deepspeed_feplb.expert_costs import device_mark
    recorded = []

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self, stream=None):
            recorded.append(stream)

    from deepspeed_feplb import expert_costs
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7000 + index, raising=False)
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda ptr, device: f"stream {ptr} of cuda:{device}")
    expert_costs._torch_stream.cache_clear()
    try:
        device_mark(torch.device("cuda", 1))
        device_mark(torch.device("cuda", 0))
        device_mark(torch.device("cuda", 1))
        assert expert_costs._torch_stream.cache_info().misses == 2  # a handle per stream, made once
    finally:
        expert_costs._torch_stream.cache_clear()
    assert recorded == ["stream 7001 of cuda:1", "stream 7000 of cuda:0", "stream 7001 of cuda:1"]


# ------------------------------------------------------------------ 4. the receiver's copy-out
def _recv_streams() -> dict:
    import torch.distributed as dist

    from deepspeed_feplb.migrate.backend import HostBackend

    class Recording(HostBackend):
        log: list = []

        def memcpy_async(self, dst, src, nbytes, stream):
            Recording.log.append(("copy", stream, nbytes))
            super().memcpy_async(dst, src, nbytes, stream)

        def stream_wait_event(self, stream, event):
            Recording.log.append(("wait", stream, None))
            super().stream_wait_event(stream, event)

        def stream_write_value32(self, stream, ptr, value):
            Recording.log.append(("flag", stream, 4))
            super().stream_write_value32(stream, ptr, value)

    rank = dist.get_rank()
    backend, t = _transport_pair(Recording)
    result = {}
    if rank == 0:
        t.send(1, 7, [torch.ones(16), torch.zeros(4)]).result(timeout=20)
    else:
        Recording.log.clear()
        got = t.recv(0, 7)
        result = {"log": list(Recording.log), "current": backend.current_stream(),
                  "ok": torch.equal(got[0], torch.ones(16))}
    dist.barrier()
    t.close()
    return result


def test_the_receiver_copies_out_on_its_receive_stream_not_on_the_compute_stream():
    from deepspeed_feplb.testing import run_distributed
    result = run_distributed(_recv_streams, 2, timeout=120)[1]
    copies = [(stream, nbytes) for op, stream, nbytes in result["log"] if op in ("copy", "flag")]
    # the two tensors' copy-outs (64 and 16 bytes) and the credit back to the sender (a flag write)
    assert result["ok"] and sorted(n for _, n in copies) == [4, 16, 64], copies
    assert all(stream != result["current"] for stream, _ in copies), "the copy-out ran on the compute stream"
    assert result["log"][-1] == ("wait", result["current"], None), "the compute stream must wait for the copy-out"


def _transport_device_of_a_layer() -> list:
    """The ``device`` and ``slot_bytes`` the domain's transport was built with, experts on the CPU."""
    import deepspeed_feplb
    from deepspeed_feplb import expert_stage
    from deepspeed_feplb.migrate.shm import ShmTransport

    built = []

    class RecordingTransport(ShmTransport):
        def __init__(self, *args, device=None, slot_bytes=0, **kwargs):
            built.append((str(device), slot_bytes))
            super().__init__(*args, device=device, slot_bytes=slot_bytes, **kwargs)

    expert_stage.transport_class = lambda config, expert_params: RecordingTransport
    torch.manual_seed(0)
    layer = deepspeed_feplb.MoE(8, torch.nn.Linear(8, 8), num_experts=4, ep_size=2, k=1, drop_tokens=False,
                                use_rts=False, feplb_config={"dynamic_experts_per_rank": 1, "fixed_costs": "ignore"})
    layer.set_deepspeed_parallelism()
    layer(torch.randn(16, 8))
    return built


def test_the_transport_is_built_on_the_experts_device_not_torchs_current_one():
    """A plain loop with ``model.to(local_rank)`` leaves torch's current device at 0: the CUDA
    transport's slots and streams must follow the experts' device, which the stage hands it."""
    # slots sized when the domain opens (`arena.slot_bytes`): D = 1 chunk of a Linear(8, 8) (288 bytes in
    # 2 tensors, + 2 tensors of slack, 256-byte aligned each) and the mean rows per rank (16 rows of 32 bytes)
    from deepspeed_feplb.migrate.arena import align_up
    from deepspeed_feplb.testing import run_distributed
    slot = align_up(1 * (288 + 4 * 256) + 16 * 32)
    assert run_distributed(_transport_device_of_a_layer, 2, timeout=120) == [[("cpu", slot)]] * 2


def test_the_preflight_names_unreachable_peers_and_the_slots_bytes():
    from deepspeed_feplb.migrate.cuda_ce import preflight_problems
    uuids = ["GPU-a", "GPU-b", "GPU-c", "GPU-a"]  # ranks 10 and 13 share a GPU: no peer access needed
    ordinal = {"GPU-a": 0, "GPU-b": 1}.get  # GPU-c is hidden from this rank (CUDA_VISIBLE_DEVICES)
    can_access = lambda a, b: False  # noqa: E731 - no pair has peer access
    ranks = [10, 11, 12, 13]
    problems = preflight_problems(0, ranks, uuids, 100 << 20, 1 << 30, ordinal, can_access)
    assert len(problems) == 2
    assert "rank 10 (cuda:0) has no peer access to rank 11 (cuda:1)" in problems[0]
    assert "feplb.nvlink_domain_size" in problems[0]
    assert "rank 10 does not see the GPU of rank 12 (GPU-c)" in problems[1] and "CUDA_VISIBLE_DEVICES" in problems[1]
    # 3 peers x 400 MiB slots beside 1 GiB free
    memory = preflight_problems(0, ranks, ["GPU-a"] * 4, 400 << 20, 1 << 30, ordinal, can_access)
    assert memory == ["rank 10 has 1,024 MiB of device memory free and its phase-2 slots need 3 x 400.0 = 1,200 MiB; "
                      "lower feplb.transport_slot_mb (larger messages then travel in parts) or "
                      "feplb.dynamic_experts_per_rank"]
    assert preflight_problems(0, ranks, ["GPU-a"] * 4, 300 << 20, 1 << 30, ordinal, can_access) == []


def _one_rank_cannot_open() -> str:
    """Rank 1's preflight reports a problem: every rank's first balanced forward refuses, alike."""
    import deepspeed_feplb
    from deepspeed_feplb import expert_stage
    from deepspeed_feplb.migrate.shm import ShmTransport

    class OneRankShort(ShmTransport):
        @staticmethod
        def preflight(device, slot, local_rank, ranks, devices):
            return [f"rank {ranks[local_rank]} short of {slot} bytes"] if local_rank == 1 else []

    expert_stage.transport_class = lambda config, expert_params: OneRankShort
    torch.manual_seed(0)
    layer = deepspeed_feplb.MoE(8, torch.nn.Linear(8, 8), num_experts=4, ep_size=2, k=1, drop_tokens=False,
                                use_rts=False, feplb_config={"dynamic_experts_per_rank": 1, "fixed_costs": "ignore"})
    layer.set_deepspeed_parallelism()
    try:
        layer(torch.randn(16, 8))
    except deepspeed_feplb.FEPLBConfigError as error:
        return str(error)
    return "opened"


def test_a_rank_that_cannot_open_the_transport_stops_every_rank_with_the_same_error():
    from deepspeed_feplb.testing import run_distributed
    errors = run_distributed(_one_rank_cannot_open, 2, timeout=120)
    assert errors[0] == errors[1] == ("FEPLB cannot open the phase-2 transport (OneRankShort) of its domains: "
                                      "rank 1 short of 2048 bytes")


def _backward_order() -> dict:
    """One balanced forward and backward of a layer whose experts log their backward: which local
    experts' backward ran before phase 2's waiting half (`Phase2MicroBatch.backward_rest`) began."""
    import torch.distributed as dist

    import deepspeed_feplb
    from deepspeed_feplb.migrate import phase2

    log = []

    class Logged(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y, expert):
            ctx.expert = expert
            return y.view_as(y)

        @staticmethod
        def backward(ctx, grad):
            log.append(("expert", ctx.expert))
            return grad, None

    class LoggedLinear(torch.nn.Linear):
        def forward(self, x):
            return Logged.apply(super().forward(x), self.expert)

    rest, home = phase2.Phase2MicroBatch.backward_rest, phase2.Phase2MicroBatch.backward_home

    def logged_home(self, *args):
        log.append(("dynamic", tuple(self.dynamic)))
        return home(self, *args)

    def logged_rest(self, *args):
        log.append(("rest", None))
        return rest(self, *args)

    phase2.Phase2MicroBatch.backward_home, phase2.Phase2MicroBatch.backward_rest = logged_home, logged_rest
    torch.manual_seed(0)
    layer = deepspeed_feplb.MoE(8, LoggedLinear(8, 8), num_experts=8, ep_size=2, k=1, drop_tokens=False,
                                use_rts=False, feplb_config={"dynamic_experts_per_rank": 1, "fixed_costs": "ignore",
                                                             "chunk_align_tokens": 1})
    for e, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
        expert.expert = e
    layer.set_deepspeed_parallelism()
    with torch.no_grad():  # every token prefers rank 0's experts: rank 0 sends rows to rank 1
        layer.deepspeed_moe.gate.wg.weight[:4] += 2.0
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(dist.get_rank())) + 1.0
    y, _, _ = layer(x.requires_grad_())
    log.clear()
    y.square().sum().backward()
    dynamic = next(entry for kind, entry in log if kind == "dynamic")
    at = log.index(("rest", None))
    before = {e for kind, e in log[:at] if kind == "expert" and e not in dynamic}
    after = {e for kind, e in log[at:] if kind == "expert" and e not in dynamic}
    return {"before": sorted(before), "after": sorted(after), "migrated": layer.feplb_stats["migrated_tokens"]}


def test_the_home_queues_its_static_experts_backward_before_it_waits_for_helpers():
    """On a GPU the host queues work and waits; phase 2's backward waits for helpers' results. If
    that wait comes first, the device idles meanwhile: the static experts' backward must be queued
    before it (autograd runs later nodes first, so phase 2's waiting half is a node made before them)."""
    from deepspeed_feplb.testing import run_distributed
    results = run_distributed(_backward_order, 2, timeout=120)
    assert sum(r["migrated"] for r in results) > 0, "nothing migrated: the test shows nothing"
    home = results[0]
    assert home["before"] and not home["after"], home


def test_the_flag_probe_writes_and_waits_on_device_and_page_locked_host_words():
    """`CudaBackend.probe_flags` (run by the CE transport when it opens, on every rank) exercises
    what the transport's flags need: stream write and wait on device memory and on registered host
    memory; a driver that refuses either is reported, not raised (the transport then carries its
    flags on the host, warning with the driver's error)."""
    from deepspeed_feplb.migrate.backend import CudaBackend

    class Driver:
        def __init__(self, fail=None):
            self.calls, self.fail = [], fail

        def _call(self, name, *args):
            self.calls.append(name)
            if name == self.fail:
                raise RuntimeError(f"{name} failed: CUDA_ERROR_NOT_SUPPORTED (801)")

        def wait(self, stream, ptr, value):
            self._call("wait", stream, ptr, value)

        def write(self, stream, ptr, value):
            self._call("write", stream, ptr, value)

        def register(self, ptr, nbytes):
            self._call("register", ptr, nbytes)
            return ptr + (1 << 40)

        def unregister(self, ptr):
            self._call("unregister", ptr)

    runtime = types.SimpleNamespace(malloc=lambda n: 4096, free=lambda p: None, streamNonBlocking=1,
                                    streamCreateWithFlags=lambda f: 11, streamDestroy=lambda s: None,
                                    streamSynchronize=lambda s: None)
    for fail in (None, "register", "wait"):
        backend = object.__new__(CudaBackend)  # no CuPy or driver here: both are faked
        backend._rt, backend._driver, backend.stream_memops = runtime, Driver(fail), True
        reason = backend.probe_flags()
        assert reason == "" if fail is None else f"RuntimeError: {fail} failed: CUDA_ERROR_NOT_SUPPORTED" in reason
        calls = backend._driver.calls
        if fail is None:
            assert calls == ["register", "write", "wait", "write", "wait", "unregister"], calls
        if fail == "wait":
            assert calls[-1] == "unregister", "the host page stays registered after a failed probe"
    backend.stream_memops, backend._driver = False, Driver()  # forced host flags (the device check's fallback run)
    assert "stream_memops=False" in backend.probe_flags() and backend._driver.calls == []


# ------------------------------------------------------------------ 7. driver calls through cuda.bindings
def _bindings_stand_in(fail: str = ""):
    """``cuda.bindings.driver`` as far as `_TypedDriver` uses it: every call returns ``(CUresult,
    *values)`` and is recorded; ``fail`` names a call that returns CUDA_ERROR_NOT_SUPPORTED."""
    import enum

    class CUresult(enum.IntEnum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_NOT_SUPPORTED = 801

    calls = []

    def call(name, *values):
        def run(*args):
            calls.append((name, args))
            return (CUresult.CUDA_ERROR_NOT_SUPPORTED,) if name == fail else (CUresult.CUDA_SUCCESS, *values)
        return run

    driver = types.SimpleNamespace(
        CUresult=CUresult, CUstream=lambda s: ("stream", s), CUdeviceptr=lambda p: ("ptr", p),
        CUstreamWaitValue_flags=types.SimpleNamespace(CU_STREAM_WAIT_VALUE_GEQ=0),
        CUstreamWriteValue_flags=types.SimpleNamespace(CU_STREAM_WRITE_VALUE_DEFAULT=0),
        CU_MEMHOSTREGISTER_PORTABLE=1, CU_MEMHOSTREGISTER_DEVICEMAP=2,
        cuGetErrorName=lambda result: (CUresult.CUDA_SUCCESS, result.name.encode()),
        cuStreamWaitValue32=call("cuStreamWaitValue32"), cuStreamWriteValue32=call("cuStreamWriteValue32"),
        cuMemHostRegister=call("cuMemHostRegister"),
        cuMemHostGetDevicePointer=call("cuMemHostGetDevicePointer", 0xD000),
        cuMemHostUnregister=call("cuMemHostUnregister"))
    return driver, calls


def test_stream_memory_operations_go_through_the_typed_bindings_with_the_flags_value_and_types():
    """The typed driver passes a stream and a device pointer as the bindings' types, the flag value
    cut to 32 bits, the cyclic >= wait and the plain write, page-locks host memory portable and
    mapped, and raises naming the call and the driver's error."""
    from deepspeed_feplb.migrate.backend import _TypedDriver
    driver, calls = _bindings_stand_in()
    typed = _TypedDriver(driver)
    typed.wait(7, 0x1000, 2**32 + 5)
    typed.write(7, 0x2000, 9)
    assert typed.register(0x3000, 4096) == 0xD000
    typed.unregister(0x3000)
    assert calls == [("cuStreamWaitValue32", (("stream", 7), ("ptr", 0x1000), 5, 0)),
                     ("cuStreamWriteValue32", (("stream", 7), ("ptr", 0x2000), 9, 0)),
                     ("cuMemHostRegister", (0x3000, 4096, 3)), ("cuMemHostGetDevicePointer", (0x3000, 0)),
                     ("cuMemHostUnregister", (0x3000,))]
    with pytest.raises(RuntimeError, match=r"cuStreamWaitValue32 failed: CUDA_ERROR_NOT_SUPPORTED \(801\)"):
        _TypedDriver(_bindings_stand_in("cuStreamWaitValue32")[0]).wait(7, 0x1000, 1)


def test_the_typed_bindings_are_taken_where_installed_and_ctypes_where_they_fail_the_probe(monkeypatch):
    """`driver_calls` takes ``cuda.bindings`` where it imports; a probe that fails through them (say,
    bindings for another CUDA major version than the driver's) is retried through ctypes, and only
    a failure of both is a reason to carry the flags on the host."""
    from deepspeed_feplb.migrate import backend as backend_module
    driver, _ = _bindings_stand_in()
    monkeypatch.setitem(sys.modules, "cuda", types.SimpleNamespace(bindings=types.SimpleNamespace(driver=driver)))
    monkeypatch.setitem(sys.modules, "cuda.bindings", sys.modules["cuda"].bindings)
    assert isinstance(backend_module.driver_calls(), backend_module._TypedDriver)

    class Ctypes:  # stands in for `_Driver` (libcuda.so.1 is not on this machine)
        def __init__(self):
            self.calls = []

        def wait(self, *args):
            self.calls.append("wait")

        def write(self, *args):
            self.calls.append("write")

        def register(self, ptr, nbytes):
            return ptr

        def unregister(self, ptr):
            pass

    monkeypatch.setattr(backend_module, "_Driver", Ctypes)
    runtime = types.SimpleNamespace(malloc=lambda n: 4096, free=lambda p: None, streamNonBlocking=1,
                                    streamCreateWithFlags=lambda f: 11, streamDestroy=lambda s: None,
                                    streamSynchronize=lambda s: None)
    backend = object.__new__(backend_module.CudaBackend)
    backend._rt, backend.stream_memops = runtime, True
    backend._driver = backend_module._TypedDriver(_bindings_stand_in("cuStreamWriteValue32")[0])
    assert backend.probe_flags() == "" and isinstance(backend._driver, Ctypes)
    assert backend._driver.calls == ["write", "wait", "write", "wait"]


def test_the_typed_driver_uses_only_names_the_installed_bindings_have():
    """Against NVIDIA's own package (the test extra installs it; it imports without a GPU): every
    call, type and constant `_TypedDriver` takes exists, and the bindings' pointer and stream types
    hold our ints."""
    driver = pytest.importorskip("cuda.bindings.driver", reason="cuda-bindings not installed (the test extra has it)")
    from deepspeed_feplb.migrate.backend import _TypedDriver
    typed = _TypedDriver(driver)
    assert typed.HOST_PORTABLE_DEVICEMAP == 3 and int(typed.WAIT_GEQ) == 0 and int(typed.WRITE_DEFAULT) == 0
    for name in ("cuStreamWaitValue32", "cuStreamWriteValue32", "cuMemHostRegister", "cuMemHostGetDevicePointer",
                 "cuMemHostUnregister", "cuGetErrorName"):
        assert callable(getattr(driver, name)), name
    assert int(driver.CUstream(7)) == 7 and int(driver.CUdeviceptr(2**40 + 8)) == 2**40 + 8
    assert driver.CUresult(801) == driver.CUresult.CUDA_ERROR_NOT_SUPPORTED


def test_a_kernel_launches_on_the_tensors_device_and_torchs_stream_there(monkeypatch):
    """`kernels.cuda._launch` (no CuPy here: CuPy and torch's stream binding are stand-ins) runs the
    kernel with the tensors' device current and torch's current stream of that device entered, read
    through torch's raw binding, and builds CuPy's handle of that stream once."""
    import sys

    from deepspeed_feplb.kernels import cuda as kernels
    log, made = [], []

    class Context:
        def __init__(self, what):
            self.what = what

        def __enter__(self):
            log.append(("enter", self.what))

        def __exit__(self, *exc):
            log.append(("exit", self.what))

    def external(ptr, index):
        made.append((ptr, index))
        return Context(("stream", ptr, index))

    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda index: Context(("device", index)),
                                                            ExternalStream=external))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7000 + index, raising=False)
    monkeypatch.setattr(kernels, "_module", lambda index: {"k": lambda grid, block, args: log.append(("run", grid))})
    kernels._external_stream.cache_clear()
    try:
        for _ in range(2):
            kernels._launch("k", torch.device("cuda", 1), 3, ())
    finally:
        kernels._external_stream.cache_clear()
    assert log[:5] == [("enter", ("device", 1)), ("enter", ("stream", 7001, 1)), ("run", (3, )),
                       ("exit", ("stream", 7001, 1)), ("exit", ("device", 1))]
    assert made == [(7001, 1)]
