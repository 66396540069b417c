"""Seeded synthetic routing-trace generators (the format of :mod:`.format`).

* :func:`skewed_trace` — per-layer expert popularity from a Zipf law (``dist="zipf"``, exponent
  ``skew``) or a Dirichlet draw (``dist="dirichlet"``, concentration ``skew``), drifting over
  micro-batches as a mean-reverting log-normal walk, with per-source-rank heterogeneity. The preset
  :func:`no_aux_trace` is calibrated so that vanilla EP at EP=8, 128 experts, top-8 wastes about
  18.6% of GPU time in the MoE layer (the FEPLB paper's motivating figure).
* :func:`biased_logits_trace` — Megatron-Core's ``moe_router_force_biased`` style: per-token
  Gaussian logits plus a fixed Gaussian per-expert bias, exact top-k per token.
* :func:`lplb_noise_trace` — DeepSeek LPLB's test workload: per-expert load
  ``clamp(randn * sigma + 1, 0) * mean`` every step, without source information.
"""
from __future__ import annotations

import numpy as np

from deepspeed_feplb.trace.format import Trace

__all__ = ["skewed_trace", "no_aux_trace", "biased_logits_trace", "lplb_noise_trace", "GENERATORS"]

# Calibrated (benchmarks/PLANNER.md): vanilla EP=8, 128 experts, top-8 wastes ~18% and has a
# token straggler of ~7,000 at 4,096 tokens per rank (paper: 18.6% and 6,666).
NO_AUX_ZIPF_S = 0.33


def _cap_probs(p: np.ndarray, top_k: int) -> np.ndarray:
    """Renormalise probabilities [..., E] so that none exceeds 1/top_k (an expert can take each
    token at most once, so it receives at most a 1/top_k share of the token-expert pairs)."""
    cap = 1.0 / top_k
    for _ in range(8):
        p = np.minimum(p, cap)
        p = p / p.sum(axis=-1, keepdims=True)
        if (p <= cap * (1 + 1e-9)).all():
            break
    return p


def skewed_trace(micro_batches: int, layers: int, ranks: int, experts: int, tokens_per_rank: int = 4096,
                 top_k: int = 8, dist: str = "zipf", skew: float = 1.0, drift: float = 0.2,
                 memory: float = 0.9, source_skew: float = 0.1, hidden: int | None = None,
                 ffn_hidden: int | None = None, seed: int = 0) -> Trace:
    """A trace [micro_batches, layers, ranks, experts] of ``tokens_per_rank * top_k`` pairs per source.

    dist/skew:    "zipf" with exponent ``skew`` (0 = uniform) over a random expert order per
                  layer, or "dirichlet" with concentration ``skew`` (small = skewed).
    drift:        std of each expert's log-popularity around its base (stationary AR(1) walk).
    memory:       AR(1) coefficient of that walk from one step to the next (0 = i.i.d.).
    source_skew:  std of an extra per-(step, source rank) log-popularity noise.
    """
    rng = np.random.default_rng(seed)
    if dist == "zipf":
        base = np.stack([-skew * np.log1p(rng.permutation(experts).astype(np.float64)) for _ in range(layers)])
    elif dist == "dirichlet":
        base = np.log(np.maximum(rng.dirichlet(np.full(experts, float(skew)), size=layers), 1e-12))
    else:
        raise ValueError(f"unknown popularity distribution {dist!r} (zipf or dirichlet)")
    walk = rng.standard_normal((layers, experts)) * drift
    innov = np.sqrt(max(0.0, 1.0 - memory * memory)) * drift
    pairs = tokens_per_rank * top_k
    counts = np.zeros((micro_batches, layers, ranks, experts), dtype=np.int64)
    for s in range(micro_batches):
        if s:
            walk = memory * walk + innov * rng.standard_normal((layers, experts))
        logits = base[:, None, :] + walk[:, None, :] + source_skew * rng.standard_normal((layers, ranks, experts))
        p = np.exp(logits - logits.max(axis=-1, keepdims=True))
        p = _cap_probs(p / p.sum(axis=-1, keepdims=True), top_k)
        counts[s] = rng.multinomial(pairs, p)
    return Trace(counts, top_k=top_k, hidden=hidden, ffn_hidden=ffn_hidden,
                 source=f"skewed_trace(dist={dist}, skew={skew}, drift={drift}, memory={memory}, "
                        f"source_skew={source_skew}, seed={seed})")


def no_aux_trace(micro_batches: int, layers: int, ranks: int = 8, experts: int = 128, tokens_per_rank: int = 4096,
                 top_k: int = 8, hidden: int | None = 6144, ffn_hidden: int | None = 2048, seed: int = 0) -> Trace:
    """Training without an auxiliary loss (GLM-5-like shapes by default): persistent hot experts
    with drift; calibrated so vanilla EP=8 wastes ~18.6% of the MoE layer's GPU time."""
    return skewed_trace(micro_batches, layers, ranks, experts, tokens_per_rank, top_k, "zipf", NO_AUX_ZIPF_S,
                        drift=0.3, memory=0.9, source_skew=0.1, hidden=hidden, ffn_hidden=ffn_hidden, seed=seed)


def biased_logits_trace(micro_batches: int, layers: int, ranks: int, experts: int, tokens_per_rank: int = 4096,
                        top_k: int = 8, bias_std: float = 1.0, hidden: int | None = None,
                        ffn_hidden: int | None = None, seed: int = 0) -> Trace:
    """Megatron-style biased random routing: logits = N(0, 1) per (token, expert) + bias[layer,
    expert] with bias ~ N(0, bias_std) fixed per layer; each token takes its top_k experts."""
    rng = np.random.default_rng(seed)
    bias = rng.standard_normal((layers, experts)) * bias_std
    counts = np.zeros((micro_batches, layers, ranks, experts), dtype=np.int64)
    for s in range(micro_batches):
        for layer in range(layers):
            layer_bias = bias[layer].astype(np.float32)
            for r in range(ranks):
                logits = rng.standard_normal((tokens_per_rank, experts), dtype=np.float32) + layer_bias
                top = np.argpartition(-logits, top_k - 1, axis=1)[:, :top_k]
                counts[s, layer, r] = np.bincount(top.ravel(), minlength=experts)
    return Trace(counts, top_k=top_k, hidden=hidden, ffn_hidden=ffn_hidden,
                 source=f"biased_logits_trace(bias_std={bias_std}, seed={seed})")


def lplb_noise_trace(micro_batches: int, layers: int, ranks: int, experts: int, tokens_per_rank: int = 4096,
                     top_k: int = 8, sigma: float = 0.3, hidden: int | None = None,
                     ffn_hidden: int | None = None, seed: int = 0) -> Trace:
    """LPLB-style i.i.d. noise: load[e] = max(0, N(1, sigma)) * mean expert load; one source rank
    (no source information)."""
    rng = np.random.default_rng(seed)
    mean = tokens_per_rank * top_k * ranks / experts
    loads = np.maximum(rng.standard_normal((micro_batches, layers, 1, experts)) * sigma + 1.0, 0.0) * mean
    return Trace(np.rint(loads).astype(np.int64), top_k=top_k, hidden=hidden, ffn_hidden=ffn_hidden,
                 source=f"lplb_noise_trace(sigma={sigma}, seed={seed})")


GENERATORS = {
    "noaux": no_aux_trace,
    "zipf": lambda *a, skew=1.0, **k: skewed_trace(*a, dist="zipf", skew=skew, **k),
    "dirichlet": lambda *a, skew=0.5, **k: skewed_trace(*a, dist="dirichlet", skew=skew, **k),
    "biased": biased_logits_trace,
    "lplb": lplb_noise_trace,
}
