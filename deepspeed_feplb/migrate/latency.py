"""What one phase-2 message costs on this domain's own transport, measured when the domain opens.

The planner prices every message at a fixed latency on top of its copy (`TimeModel.message_us`).
That latency depends on the transport, the machine and its load, so the runtime measures it
instead of assuming it: a one-element token goes round the domain's ring of ranks, each rank
passing it on as soon as it has it, the way phase 2 passes rows on (on a GPU: the receive's
copy-out on the caller's stream, the next send after it, so no host waits for the device; on the
CPU each host waits for the data). The time from rank 0's first send to its last receive's data,
over the messages sent, is one message's latency: the host enqueue work of both ends, the
signal, and a copy too small to count.
"""
from __future__ import annotations

import time

import torch

PROBE = 0xF  # the tag's phase nibble: phase 2's own messages use 1-5 (`phase2.tag`)
WARM_LAPS, LAPS = 1, 8


def _tag(lap: int) -> int:
    return (lap << 4) | PROBE


def measure_message_us(transport, local_rank: int, size: int, device=None, laps: int = LAPS) -> float:
    """One message's latency on ``transport`` in µs (collective over the domain's ``size`` ranks):
    the token goes round the ring ``laps`` times after a warm-up lap (mapping peers, first
    buffers), then rank 0 sends the figure round once more so that every rank returns the same.
    0.0 for a domain of one rank (no messages)."""
    if laps < 1:
        raise ValueError(f"measure_message_us: laps must be >= 1, got {laps}")
    if size < 2:
        return 0.0
    after, before = (local_rank + 1) % size, (local_rank - 1) % size
    token = torch.zeros(1, device=device)
    sent = []
    if local_rank == 0:
        for lap in range(WARM_LAPS + laps):
            if lap == WARM_LAPS:
                _settle(sent, token)
                start = time.perf_counter()
            sent.append(transport.send(after, _tag(lap), [token]))
            token = transport.recv(before, _tag(lap))[0]
        _settle(sent, token)
        figure = (time.perf_counter() - start) / (laps * size) * 1e6
        result = torch.tensor([figure], dtype=torch.float64, device=device)
        sent.append(transport.send(after, _tag(WARM_LAPS + laps), [result]))
        transport.recv(before, _tag(WARM_LAPS + laps))
    else:
        for lap in range(WARM_LAPS + laps):
            token = transport.recv(before, _tag(lap))[0]
            sent.append(transport.send(after, _tag(lap), [token]))
        result = transport.recv(before, _tag(WARM_LAPS + laps))[0]
        sent.append(transport.send(after, _tag(WARM_LAPS + laps), [result]))
        figure = float(result[0])  # a host read: waits for the copy-out, once
    _settle(sent, token)
    return figure


def _settle(sent: list, token: torch.Tensor) -> None:
    """Wait for this rank's sends and for the device work queued so far (the token's copy-out)."""
    for future in sent:
        future.result()
    sent.clear()
    if token.is_cuda:
        torch.cuda.synchronize(token.device)
