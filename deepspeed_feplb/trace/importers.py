"""Importers from other tools' routing logs into FEPLB's trace format (:mod:`.format`).

Megatron-Core ``router_trace`` (``--moe-routing-trace-path``): one JSONL file per rank,
``router_trace_rank{rank}.jsonl``, one record per router call::

    {"step": 0, "stage": "pre_dispatch", "block": "decoder", "layer": 3, "rank": 0,
     "num_tokens": 128, "topk": 8, "top_indices": [[12, 45, ...], ...]}

In training every micro-batch (and an activation recompute) fires the router, so one
``(step, layer, rank)`` can have several records: the k-th of them is micro-batch k of that step,
and each (step, micro-batch) becomes one trace step. Records with ``mtp_idx`` (multi-token
prediction layers) are skipped unless ``include_mtp``. Layer numbers are mapped, in ascending
order, to 0..layers-1.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Iterable

import numpy as np

from deepspeed_feplb.trace.format import Trace

__all__ = ["read_megatron_router_trace"]

MAX_EXPERTS = 2 ** 20  # a larger expert index is a corrupt record, not a model (the counts get a column per expert)


def _files(paths: Iterable[str | os.PathLike]) -> list[str]:
    out = []
    for p in paths:
        p = os.fspath(p)
        if os.path.isdir(p):
            out.extend(sorted(glob.glob(os.path.join(p, "router_trace_rank*.jsonl"))))
        else:
            out.append(p)
    if not out:
        raise ValueError("no Megatron router_trace JSONL files found")
    return out


def read_megatron_router_trace(paths: Iterable[str | os.PathLike], num_experts: int | None = None,
                               include_mtp: bool = False) -> Trace:
    """Read Megatron-Core router_trace JSONL files (or directories holding them) into a Trace
    with counts int64 [steps * micro-batches, layers, ranks, experts]."""
    hist = {}  # (step, micro, layer, rank) -> counts
    seen = {}  # (step, layer, rank) -> micro-batches so far
    topk = None
    max_expert = -1
    files = _files(paths)
    for path in files:
        with open(path, errors="replace") as f:  # binary garbage then fails as a record naming its line
            for lineno, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    rec = json.loads(line)
                    if "mtp_idx" in rec and not include_mtp:
                        continue
                    step, layer, rank = int(rec["step"]), int(rec["layer"]), int(rec["rank"])
                    idx = np.asarray(rec["top_indices"], dtype=np.int64)
                    if "mtp_idx" in rec:
                        layer = -1 - int(rec["mtp_idx"]) * 100000 - layer  # keep MTP layers distinct
                    topk = int(rec.get("topk", idx.shape[-1] if idx.ndim == 2 else 1))
                except (KeyError, ValueError, TypeError, OverflowError) as e:
                    raise ValueError(f"{path}:{lineno}: not a router_trace record ({e})") from None
                key = (step, layer, rank)
                micro = seen.get(key, 0)
                seen[key] = micro + 1
                flat = idx.reshape(-1)
                if flat.size:
                    max_expert = max(max_expert, int(flat.max()))
                    if flat.min() < 0:
                        raise ValueError(f"{path}:{lineno}: negative expert index")
                    if flat.max() >= MAX_EXPERTS:
                        raise ValueError(f"{path}:{lineno}: expert index {flat.max()} is not below {MAX_EXPERTS}")
                hist[(step, micro, layer, rank)] = np.bincount(flat, minlength=1)
    if not hist:
        raise ValueError(f"{', '.join(files)}: no router_trace records")
    E = num_experts if num_experts is not None else max_expert + 1
    if max_expert >= E:
        raise ValueError(f"expert index {max_expert} out of range for {E} experts")
    steps = sorted({(k[0], k[1]) for k in hist})
    layers = sorted({k[2] for k in hist})
    ranks = sorted({k[3] for k in hist})
    s_ix = {k: i for i, k in enumerate(steps)}
    l_ix = {k: i for i, k in enumerate(layers)}
    r_ix = {k: i for i, k in enumerate(ranks)}
    counts = np.zeros((len(steps), len(layers), len(ranks), E), dtype=np.int64)
    for (step, micro, layer, rank), c in hist.items():
        counts[s_ix[(step, micro)], l_ix[layer], r_ix[rank], :c.shape[0]] += c
    return Trace(counts, top_k=topk, source=f"megatron router_trace ({len(ranks)} ranks)")
