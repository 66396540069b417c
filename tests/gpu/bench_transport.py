"""What one phase-2 message costs on a GPU: `CudaCETransport` ping-pong between two processes.

    python tests/gpu/bench_transport.py OUT.json          # on a GPU machine (two ranks share GPU 0)
    python tests/gpu/bench_transport.py --cpu OUT.json    # the same protocol on host memory (dry run)
    python tests/gpu/bench_transport.py --profile OUT.json  # also rank 0's cProfile (OUT.json.prof.txt)
    python tests/gpu/bench_transport.py --back-to-back OUT.json  # no barrier between round trips
    python tests/gpu/bench_transport.py --host-flags OUT.json    # the fallback without stream memory operations

For each message size (one tensor, 4 KiB to 64 MiB) rank 0 sends, rank 1 receives and sends the
same bytes back, ``rounds`` times after a warm-up; the clock stops once rank 0's received tensor
is on the device (``torch.cuda.synchronize``); the ranks meet at a barrier before each round trip
(``--back-to-back``: they do not, so each round trip starts as the previous one ended). Reported
per size: the median round trip, half of it as the one-way time of a message, the bandwidth that
implies, and the CPU time rank 0's process spends per round trip (one ``send`` and one ``recv``:
Python, events, the control block and its background thread; waiting sleeps and costs none). On
one GPU the copies are device-to-device, not the NVLink copy engine between two GPUs. The fixed
cost per message (small sizes) is what each domain measures when it opens
(`migrate.latency.measure_message_us`) and the planner prices.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)


def _ping_pong(rounds: int, cpu: bool, profile: bool = False, back_to_back: bool = False,
               host_flags: bool = False) -> dict:
    import torch
    import torch.distributed as dist

    from deepspeed_feplb.migrate.backend import CudaBackend, HostBackend
    from deepspeed_feplb.migrate.cuda_ce import CudaCETransport
    if not cpu:
        torch.cuda.set_device(0)
    sync = (lambda: None) if cpu else torch.cuda.synchronize
    rank = dist.get_rank()
    names = [f"feplb-benchtransport-{os.getpid()}-{time.monotonic_ns()}"]
    dist.broadcast_object_list(names, 0)

    def make(create: bool):
        memops = not host_flags
        backend = HostBackend(prefix=f"{names[0]}-mem", stream_memops=memops) if cpu else \
            CudaBackend(stream_memops=memops)
        return CudaCETransport(names[0], rank, 2, 60.0, create, backend=backend, slot_bytes=max(SIZES) + (1 << 20))

    if rank == 0:
        t = make(True)
    dist.barrier()
    if rank:
        t = make(False)
    out = {}
    tag = 0
    import cProfile
    profiler = cProfile.Profile() if profile and rank == 0 else None
    for size in SIZES:
        x = torch.full((size // 4, ), float(rank + 1), device="cpu" if cpu else "cuda")
        trips, cpu_s = [], []
        dist.barrier()
        for i in range(rounds + 5):
            if not back_to_back:
                dist.barrier()
            sync()
            start, start_cpu = time.perf_counter(), time.process_time()
            if rank == 0:
                if profiler is not None and size == SIZES[0] and i >= 5:
                    profiler.enable()
                future = t.send(1, tag, [x])
                got = t.recv(1, tag)
                sync()
                if profiler is not None:
                    profiler.disable()
                trips.append(time.perf_counter() - start)
                cpu_s.append(time.process_time() - start_cpu)
                future.result(timeout=60)
                assert float(got[0][0]) == 2.0 and got[0].numel() == x.numel()
            else:
                got = t.recv(0, tag)
                t.send(0, tag, [torch.full_like(got[0], 2.0)]).result(timeout=60)
            tag += 1
        if rank == 0:
            trips, cpu_s = sorted(trips[5:]), sorted(cpu_s[5:])
            rtt = trips[len(trips) // 2]
            out[str(size)] = {"round_trip_us": round(rtt * 1e6, 1), "one_way_us": round(rtt * 5e5, 1),
                              "gbps": round(size / (rtt / 2) / 1e9, 2),
                              "cpu_us_per_round_trip": round(cpu_s[len(cpu_s) // 2] * 1e6, 1)}
    dist.barrier()
    t.close()
    if profiler is not None:
        import io
        import pstats
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
        out["profile"] = text.getvalue()
    return out


def main(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="transport_speed.json", help="where the JSON goes")
    parser.add_argument("--cpu", action="store_true", help="the same protocol on host memory (HostBackend)")
    parser.add_argument("--profile", action="store_true", help="also rank 0's cProfile (OUT.prof.txt)")
    parser.add_argument("--back-to-back", action="store_true", help="no barrier between round trips")
    parser.add_argument("--host-flags", action="store_true",
                        help="the transport's fallback for drivers without stream memory operations")
    parser.add_argument("--rounds", type=int, help="round trips per size after the warm-up (5 on --cpu, else 50)")
    args = parser.parse_args(argv)
    cpu, profile, out_path = args.cpu, args.profile, Path(args.out)
    import torch
    if not cpu and not torch.cuda.is_available():
        print("bench_transport: needs a CUDA device (or --cpu for the dry run)", file=sys.stderr)
        return 2
    from deepspeed_feplb.testing import run_distributed
    rounds = args.rounds if args.rounds is not None else 5 if cpu else 50
    if rounds < 1:
        parser.error(f"--rounds must be >= 1, got {rounds}")
    results = run_distributed(_ping_pong, 2, rounds, cpu, profile, args.back_to_back, args.host_flags, timeout=300)
    text = results[0].pop("profile", None)
    if text is not None:
        Path(f"{out_path}.prof.txt").write_text(text)
    figures = {"device": "cpu (HostBackend)" if cpu else torch.cuda.get_device_name(0), "rounds": rounds,
               "back_to_back": args.back_to_back, "host_flags": args.host_flags,
               "sizes": results[0], "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    out_path.write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
