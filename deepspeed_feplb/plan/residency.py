"""Weight residency: which helper holds a copy of which expert's weights during an optimizer step.

Weights change only at the optimizer step, so a helper that received expert ``(home, e)`` in one
micro-batch can serve it again in the step's later micro-batches without a new copy, and return
the copy's accumulated weight-gradient once, at the step's last micro-batch (``feplb.
weight_residency: "step"``). Every rank of a domain sees the same plans in the same order, so
every rank (and the simulator) derives the same table from them with `ResidencyTable.admit`:
no message says what is resident.

A helper keeps at most ``max_resident`` copies per layer, and, over all the layers that share a
domain, at most a byte budget (`KeptBytes`: each copy counts its weights and its fp32 weight-
gradient); a copy beyond either is used for its micro-batch only and returns its gradients at
once, as with ``weight_residency: "micro_batch"`` (``max_resident = 0``). Layers run their
forwards in the same order on every rank, so the shared budget is the same on every rank too.
"""
from __future__ import annotations

import numpy as np

__all__ = ["KeptBytes", "ResidencyTable", "resident_budget_bytes", "step_end_returns", "used_at_step_end",
           "AUTO_FREE_SHARE"]

AUTO_FREE_SHARE = 0.5  # ``resident_budget_mb: "auto"``: this share of the memory FEPLB's other buffers leave free


def resident_budget_bytes(resident_budget_mb, free_bytes: list, most_bytes: float = float("inf")) -> float:
    """Bytes of kept copies each rank of a domain may hold over its layers: ``resident_budget_mb``
    (``feplb.resident_budget_mb``) MiB, or for "auto" the smaller of ``most_bytes`` (what they can
    ever take: layers x ``max_resident_experts`` x a kept copy's bytes) and `AUTO_FREE_SHARE` of
    the least device memory the domain's ranks have free beside FEPLB's other buffers
    (``free_bytes``, one per rank; None or inf: host memory, no budget); the other half is left to
    activations. The runtime (`memory.check_at_initialize`, else `domain.DomainRuntime` when it
    opens) and the simulator (`sim.policies`, from its profile) use this one rule."""
    if resident_budget_mb != "auto":
        return float(resident_budget_mb) * 2**20
    known = [b for b in free_bytes if b is not None and np.isfinite(b)]
    return min(float(most_bytes), AUTO_FREE_SHARE * max(0.0, min(known))) if known else float("inf")


def used_at_step_end(moves: np.ndarray, with_results: np.ndarray) -> np.ndarray:
    """The kept copies the step's last micro-batch used (its moves int64 [M, 4] whose results carry
    the step's gradients, `step_end_returns`), int64 [K, 3] = (home, local_expert, helper), sorted:
    those `ResidencyTable.keep` holds for the next step."""
    moves = np.asarray(moves, np.int64).reshape(-1, 4)
    return np.unique(moves[np.asarray(with_results, np.bool_)][:, :3], axis=0).reshape(-1, 3)


def step_end_returns(entries: np.ndarray, moves: np.ndarray, kept: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """How the kept copies' step gradients go home in the step's last micro-batch: a copy that a
    move of its plan uses returns them with that move's results (its last move, where the plan
    has more of one home expert for one helper), every other at the start of the backward.
    entries int64 [K, 3] = (home, local_expert, helper) (`ResidencyTable.flush`); moves int64 [M, 4];
    kept bool [M] (`ResidencyTable.admit`'s). Returns (with_results bool [M], early int64 [F, 3]:
    the entries no move uses, in ``entries``' order)."""
    moves = np.asarray(moves, np.int64).reshape(-1, 4)
    last = {}
    for m, (home, e, helper, _) in enumerate(moves.tolist()):
        if kept[m]:
            last[(home, e, helper)] = m
    with_results = np.zeros(len(moves), np.bool_)
    with_results[list(last.values())] = True
    early = [row for row in np.asarray(entries, np.int64).reshape(-1, 3).tolist() if tuple(row) not in last]
    return with_results, np.array(early, np.int64).reshape(-1, 3)


class KeptBytes:
    """Bytes of kept copies that each of a domain's ``G`` ranks holds over all its layers, against
    one per-rank ``budget`` (bytes; ``inf``: none). ``held``: int64 [G]."""

    def __init__(self, G: int, budget: float):
        self.budget = float(budget)
        self.held = np.zeros(G, np.int64)

    def take(self, rank: int, nbytes: int) -> bool:
        """Count a copy of ``nbytes`` on ``rank`` if it fits the budget; whether it did."""
        if self.held[rank] + nbytes > self.budget:
            return False
        self.held[rank] += nbytes
        return True


def _has(mask: np.ndarray, home: int, e: int, helper: int) -> bool:
    """Bit ``helper`` of ``mask[home, e]`` (int64 [G, E, ceil(G / 64)] bit masks)."""
    return bool((int(mask[home, e, helper >> 6]) >> (helper & 63)) & 1)


def _set(mask: np.ndarray, home: int, e: int, helper: int) -> None:
    mask[home, e, helper >> 6] |= np.int64(1) << np.int64(helper & 63)


class ResidencyTable:
    """The kept weight copies of one MoE layer in one domain of ``G`` ranks with ``E`` local experts.

    resident:  int64 [G, E, ceil(G / 64)] bit masks: bit ``j % 64`` of word ``j // 64`` of
               ``resident[home, e]`` says rank j holds a copy of ``home``'s local expert e (the
               `plan.policy.plan_domain` argument);
    used:      the copies a move of this step used, as ``resident`` (a copy held again for the next
               step, `keep`, that none uses has no gradient to return);
    held:      int64 [G]: copies each rank holds;
    kept_bytes: the domain's `KeptBytes` shared with its other layers (None: no byte budget), each
               copy of this layer counting ``copy_bytes``.
    """

    def __init__(self, G: int, E: int, max_resident: int, kept_bytes: KeptBytes | None = None, copy_bytes: int = 0):
        self.max_resident = int(max_resident)
        self.kept_bytes, self.copy_bytes = kept_bytes, int(copy_bytes)
        self.resident = np.zeros((G, E, (G + 63) // 64), np.int64)
        self.used = np.zeros_like(self.resident)
        self.held = np.zeros(G, np.int64)

    def holds(self, home: int, e: int, helper: int) -> bool:
        return _has(self.resident, home, e, helper)

    def _hold(self, home: int, e: int, helper: int) -> bool:
        """Hold a new copy if ``helper`` has room for it (``max_resident``, the byte budget); whether it did."""
        if self.held[helper] >= self.max_resident or not (
                self.kept_bytes is None or self.kept_bytes.take(helper, self.copy_bytes)):
            return False
        _set(self.resident, home, e, helper)
        self.held[helper] += 1
        return True

    def admit(self, moves: np.ndarray, keep_new: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Account one micro-batch's plan. moves int64 [M, 4] = (home, local_expert, helper, rows).

        Returns (fresh bool [M]: the move carries the weights, the helper holds no copy yet;
        kept bool [M]: the helper keeps the copy (now or from before), so the chunk's weight-
        gradients stay there until `flush`). A helper with ``max_resident`` copies, or whose
        `KeptBytes` has no room for one more, keeps no more, and none is kept with
        ``keep_new=False`` (the step's last micro-batch: nothing follows).
        """
        moves = np.asarray(moves, np.int64).reshape(-1, 4)
        M = moves.shape[0]
        fresh = np.ones(M, np.bool_)
        kept = np.zeros(M, np.bool_)
        for m, (home, e, helper, _) in enumerate(moves.tolist()):
            if self.holds(home, e, helper):
                fresh[m], kept[m] = False, True
            elif keep_new:
                kept[m] = self._hold(home, e, helper)
            if kept[m]:
                _set(self.used, home, e, helper)
        return fresh, kept

    def keep(self, entries: np.ndarray) -> np.ndarray:
        """Hold the copies ``entries`` int64 [K, 3] = (home, local_expert, helper) again (the next
        step's, after a `flush`), within ``max_resident`` and the byte budget as `admit` keeps new
        ones; returns which were kept, bool [K]."""
        entries = np.asarray(entries, np.int64).reshape(-1, 3)
        kept = np.zeros(len(entries), np.bool_)
        for k, (home, e, helper) in enumerate(entries.tolist()):
            kept[k] = not self.holds(home, e, helper) and self._hold(home, e, helper)
        return kept

    def entries(self, used: bool = False) -> np.ndarray:
        """int64 [K, 3] = (home, local_expert, helper) of every kept copy (``used``: that a move of
        this step used), sorted."""
        mask = self.used if used else self.resident
        G = mask.shape[0]
        homes, experts = np.nonzero(mask.any(axis=2))
        rows = [(h, e, j) for h, e in zip(homes.tolist(), experts.tolist()) for j in range(G) if _has(mask, h, e, j)]
        return np.array(rows, np.int64).reshape(-1, 3)

    def flush(self) -> np.ndarray:
        """End of the step: forget every copy; returns the `entries` whose gradients go home now
        (those a move of the step used: a copy held again for it that none used has none)."""
        out = self.entries(used=True)
        if self.kept_bytes is not None:
            self.kept_bytes.held -= self.held * self.copy_bytes
        self.resident[:] = 0
        self.used[:] = 0
        self.held[:] = 0
        return out

    def __len__(self) -> int:
        return int(self.held.sum())
