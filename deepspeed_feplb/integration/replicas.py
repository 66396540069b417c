"""Replica slots at runtime (``feplb.placement.redundant_experts_per_rank``): copies of hot experts on
other nodes, chosen at placement decisions (`plan.replicas.choose`), each micro-batch's rows split
between an expert's holders (`plan.replicas.split`).

A replica holds the expert's weights only. It is neither a parameter of the model nor of the
optimizer, so ZeRO partitions, optimizer state, state dicts and checkpoints never see it:

* **Weights** come from the expert's home (its primary slot) at the first forward after each
  optimizer step, and after anything that may have changed them (a decision, a checkpoint load,
  a `canonical_experts` block, `weight_watch.weights_changed`): `ReplicaSlots.refresh`. Under a
  DeepSpeed engine they leave when ``engine.forward`` begins, every layer's at once
  (`ReplicaSlots.refresh_ahead`; on a CUDA device queued on `relay_stream`), so that they travel
  while the layers before each one compute; the layer's forward waits for them (in stream
  order) before its experts compute. At the
  first forward of every other accumulation cycle (after an evaluation, say, with other weights
  swapped in and out through ``p.data``), the homes' and the holders' `weight_watch.content_hash`
  are compared, and a difference refreshes (`ReplicaSlots.keep_current`); an in-place write
  between micro-batches, seen by the home's version counters alone, travels with the route
  counts every forward gathers (`ExpertPlacement.route`).
* **Gradients**: the layer computes a replica slot like any local expert, on parameters that are
  aliases of the replica's weights (`deepspeed_moe.ExpertGradOrder`). Its backward hands the
  replicas' gradients to `ReplicaSlots.backward`, which sums them over the step's micro-batches
  in fp32 and, where the gradients are narrower than fp32 (bf16, fp16) and the step has more than
  one micro-batch, sends them to the expert's home in two halves (for each home, as many
  replicas' as it has replica slots, the first in holder order: memory counts that many; the
  others' go whole at the end): the sum of every micro-batch but the last in the backward of the
  one before last (on a CUDA device queued on a stream of
  its own, `relay_stream`, so it travels while the last micro-batch computes), and in the last
  one's backward that micro-batch's gradient alone, in its own dtype (half the bytes of the fp32
  sum). The home adds the two in fp32 as the holder would have (the same sum, bit for bit) and
  the result joins the expert's own gradient before DeepSpeed reduces it (ZeRO 0/1/2 alike: to
  DeepSpeed it is part of that micro-batch's gradient). Otherwise (fp32 gradients, whose last
  half would be as large as the whole; a step of one micro-batch) the sum goes in the last
  backward, in one. Training equals DeepSpeed's MoE. In a DeepSpeed MoE layer (`holds_back`) the
  experts at `held_back_locals` take the last sums only when the whole backward ends
  (`at_backward_end`): every rank holds their gradients of the step's last micro-batch back to
  then, so the sums travel while the layers below compute, and DeepSpeed's hooks fire in the same
  order on every rank.

Both cross nodes, and both go through `relay`, which spreads each transfer over every
inter-node link of the two nodes (a node has one per rank) and pipelines its three hops. Every
rank of the EP group runs `refresh` and `backward` alike (both are collective), from the same
replica table (`ExpertPlacement.replica_at`).
"""
from __future__ import annotations

import functools
import warnings
from collections import defaultdict
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.autograd.graph import increment_version

from deepspeed_feplb.kernels.cuda import cuda_index
from deepspeed_feplb.migrate.phase2 import on_stream
from deepspeed_feplb.plan.replicas import RELAY_CHUNK_BYTES, early_sums, held_back_locals
from deepspeed_feplb.stats import recomputing
from deepspeed_feplb.weight_watch import content_hash, write_marks


def relay(transfers: list[tuple[int, int, list[torch.Tensor]]], me: int, ranks_per_node: int,
          peer: Callable[[int], int], device: torch.device, chunk_bytes: int = RELAY_CHUNK_BYTES) -> None:
    """Move tensors between ranks of a process group, each transfer over every link of its two
    nodes. Collective: every rank passes the same ``transfers`` in the same order.

    A transfer ``(src, dst, tensors)`` copies ``tensors`` from rank ``src`` to rank ``dst`` (group
    ranks; on ``src`` the data, on ``dst`` buffers written in place, on every other
    rank tensors of the same shapes and dtypes, neither read nor written: ``meta`` ones do). Between
    nodes of ``ranks_per_node`` ranks, each tensor is cut into ``ranks_per_node`` shards; shard k
    goes from ``src`` to the k-th rank of its node, from there to the k-th rank of ``dst``'s node
    (one inter-node link per rank: all of them carry a share), and on to ``dst``, the two ranks
    between holding it in a buffer on ``device``. Each shard moves in pieces of ``chunk_bytes``
    (numbered on through the transfer's tensors), piece c crossing hop h in round c + h, so the
    hops overlap; a round is one `torch.distributed.batch_isend_irecv` (``peer``: group rank ->
    global rank). `plan.replicas.relay_us` prices it."""
    G = ranks_per_node
    rounds: dict[int, list] = defaultdict(list)
    copy_back = []  # (destination, contiguous buffer received into) where the destination is not contiguous
    for src, dst, tensors in transfers:
        between_nodes = src // G != dst // G
        pieces = [0] * G  # per shard: the transfer's pieces so far (its tensors' pieces follow each other)
        for tensor in tensors:
            if me == dst and not tensor.is_contiguous():
                copy_back.append((tensor, tensor.contiguous()))
                tensor = copy_back[-1][1]
            flat = tensor.reshape(-1)
            for k, shard in enumerate(flat.tensor_split(G) if between_nodes else [flat]):
                path = [src, src // G * G + k, dst // G * G + k, dst] if between_nodes else [src, dst]
                path = [r for i, r in enumerate(path) if i == 0 or r != path[i - 1]]
                if not shard.numel():
                    continue
                split = shard.split(max(1, chunk_bytes // shard.element_size()))
                first, pieces[k] = pieces[k], pieces[k] + len(split)
                if me not in path:
                    continue
                i = path.index(me)
                if me not in (src, dst):
                    split = torch.empty(shard.shape, dtype=shard.dtype, device=device).split(split[0].numel())
                for c, piece in enumerate(split, start=first):
                    if i > 0:
                        rounds[c + i - 1].append(dist.P2POp(dist.irecv, piece, peer(path[i - 1])))
                    if i < len(path) - 1:
                        rounds[c + i].append(dist.P2POp(dist.isend, piece, peer(path[i + 1])))
    for r in sorted(rounds):
        for request in dist.batch_isend_irecv(rounds[r]):
            request.wait()
    for tensor, received in copy_back:
        tensor.copy_(received)


def with_sum(grads: list[torch.Tensor], sums: list[torch.Tensor]) -> list[torch.Tensor]:
    """An expert's weight-gradients ``grads`` with a replica's fp32 gradient sums added (in fp32,
    rounded once to the gradients' dtype)."""
    return [(g.float() + s).to(g.dtype) for g, s in zip(grads, sums)]


class ReplicaSlots:
    """This rank's ``S`` replica slots of one MoE layer.

    Args:
        placement: the layer's `integration.placement.ExpertPlacement` (its tables say which
            expert each slot holds and where each expert's home is).
        template: one expert's parameters (shapes, dtypes, device of the copies).
        slots: S, replica slots per rank.
    """

    def __init__(self, placement, template: list[torch.Tensor], slots: int):
        self.placement = placement
        self.weights = [[torch.zeros_like(p, memory_format=torch.contiguous_format).detach() for p in template]
                        for _ in range(slots)]  # [S][n]: what each slot computes with
        self._sums: list[Optional[list[torch.Tensor]]] = [None] * slots  # the step's gradients so far, per slot
        self._experts = [-1] * slots  # the expert each of this rank's slots held at the last refresh
        self.stale = True  # the weights may differ from their experts' (set by the placement, cleared by refresh)
        self.check_due = True  # the next forward begins an accumulation cycle: compare contents (`keep_current`)
        self._marks: Optional[tuple] = None  # `write_marks` of the homes' weights when last found current
        self._watched: list[torch.Tensor] = []  # this rank's expert parameters (`keep_current`)
        self.refreshes = 0  # times the weights were sent
        self.grad_sends = 0  # replica gradients sent home at a step's end (by this rank's slots)
        self.early_sends = 0  # sums sent home a micro-batch before the step's end (by this rank's slots)
        self._early: Optional[_EarlySums] = None  # the step's sums sent early, until its last backward
        self._last: Optional[_LastSums] = None  # the step's last exchange, until `arrived` takes it
        self._late: Optional[_LastSums] = None  # its sums for held-back experts, until the backward's end
        self.holds_back = False  # a DeepSpeed MoE layer's: `held_back_locals` apply (an AutoEP layer's: none)
        # whether the running backward is the engine's (`seams.in_engine_backward`), and whether the
        # last one through the layer was: gradients are held back only after one was
        self.in_engine_backward: Callable[[], bool] = lambda: True
        self._engine_backward_seen = False
        self._deliveries: list[tuple] = []  # held-back gradients of the running backward, until its end
        self.held_back = 0  # steps whose held-back gradients were delivered with their sums (`at_backward_end`)
        self.ahead_refreshes = 0  # refreshes sent when the engine's forward began (`refresh_ahead`)
        self._homes: Optional[Callable[[], list[list[torch.Tensor]]]] = None  # `keep_current`'s expert_params
        self._arriving = None  # CUDA event after a `refresh_ahead` relay, until the layer's forward waits for it

    @property
    def me(self) -> int:
        group = self.placement.ep_group
        return dist.get_rank(group) if group is not None else 0

    @property
    def device(self) -> torch.device:
        return self.weights[0][0].device

    @property
    def narrow(self) -> bool:
        """Whether the replicas' gradients are narrower than fp32 (bf16, fp16): their step sum then
        goes home in two halves, the last one in their own dtype (`backward`)."""
        return all(w.element_size() < 4 for w in self.weights[0])

    @staticmethod
    def _shapes(tensors: list[torch.Tensor], dtype: Optional[torch.dtype] = None) -> list[torch.Tensor]:
        """Storage-less stand-ins of ``tensors`` (their shapes, and ``dtype`` or theirs), for `relay`
        on a rank that neither sends nor receives the transfer."""
        return [torch.empty(t.shape, dtype=dtype or t.dtype, device="meta") for t in tensors]

    def _peer(self, rank: int) -> int:
        return dist.get_global_rank(self.placement.ep_group, int(rank))

    def _held(self) -> list[tuple[int, int, int]]:
        """(rank, slot, expert) of every held replica slot of the EP group, in rank then slot order."""
        at = self.placement.replica_at
        return [(int(q), int(j), int(at[q, j])) for q, j in zip(*np.nonzero(at >= 0))]

    def refresh(self, expert_params: list[list[torch.Tensor]], ahead: bool = False) -> None:
        """Collective over the EP group: every held replica slot receives its expert's current
        weights from the expert's home (``expert_params``: this rank's primary experts' parameters,
        ``[E_local][n]``). ``ahead`` (`refresh_ahead`): on a CUDA device the relay is queued on
        `relay_stream`, and `keep_current` makes the caller's stream wait for it."""
        self.wait_arriving()  # a relay still writing the slots goes first
        me = self.me

        def transfers() -> tuple[list, None]:
            out = []
            for q, j, e in self._held():
                home, local = self.placement.home_of(e)
                if home == me == q:
                    raise AssertionError(f"expert {e} has a replica on its own home rank {me}")
                out.append((home, q, [p.detach().contiguous() for p in expert_params[local]] if home == me
                            else self.weights[j] if q == me else self._shapes(self.weights[0])))
            return out, None

        with torch.no_grad():
            _, self._arriving = self._relayed(transfers, queued=ahead)
            for j in range(len(self.weights)):
                # received by the process group, which writes no version: a helper's kept copy of the slot
                # (`LayerResidency.stamp`) must see the new weights
                for w in self.weights[j]:
                    increment_version(w)
        # a slot that now holds another expert starts its sum afresh; one that holds the same (a
        # refresh in the middle of a step, after a `canonical_experts` block) keeps it
        now = self.placement.replica_at[me].tolist()
        self._sums = [s if e == before else None for s, e, before in zip(self._sums, now, self._experts)]
        self._experts = now
        self.stale = False
        self.refreshes += 1

    def refresh_ahead(self) -> bool:
        """Collective over the EP group, where the engine's forward begins (before any layer runs):
        `refresh` now, on `relay_stream`, where the weights may be stale (the optimizer step, a
        decision, a load, a declared change), with the experts' parameters that `keep_current` was
        last given the means to find; the layer's own forward then only waits for them. What
        happens in between is seen as before: an in-place write (`ExpertPlacement.route`) makes them
        stale again. Returns whether it sent."""
        if self._homes is None or not self.stale or not self.placement.holds_replicas:
            return False
        with self.placement.timing_replicas():
            self.refresh(self._homes(), ahead=True)
        self.check_due = False  # as current as a content check would find them
        self._marks = write_marks(self._watched)
        self.ahead_refreshes += 1
        return True

    def wait_arriving(self) -> None:
        """The caller's stream waits for a `refresh_ahead` relay still under way (no host wait): before
        anything writes the slots or reads them, or writes the experts' parameters it reads (the
        layer's forward; the end of the engine's forward, for a layer that did not run, so that the
        optimizer step and placement moves come after it)."""
        if self._arriving is not None:
            torch.cuda.current_stream(self.device).wait_event(self._arriving)
            self._arriving = None

    def keep_current(self, expert_params: Callable[[], list[list[torch.Tensor]]], step_ends: bool,
                     watched: list[torch.Tensor]) -> None:
        """At a forward (collective over the EP group, not in a recomputed one, where the original
        forward's weights hold): make every held replica's weights its home's, as they are now.
        `refresh` where they may be stale (the optimizer step, a decision, a load, a declared
        change, or an in-place write `ExpertPlacement.route` learnt of); at the first forward of an
        accumulation cycle, compare contents first (`changed`). ``expert_params``: called for
        `refresh`'s argument; ``step_ends``: this forward is its cycle's last (so the next begins
        one); ``watched``: this rank's expert parameters (or their stacked tensors), whose
        `write_marks` show an in-place write (`wrote_in_place`). ``expert_params`` must find the
        parameters when called: `refresh_ahead` calls it at the next forward's start."""
        self._watched, self._homes = watched, expert_params
        if recomputing() or not self.placement.holds_replicas:
            return
        self.wait_arriving()
        with self.placement.timing_replicas():
            if self.stale or (self.check_due and self.changed(expert_params())):
                self.refresh(expert_params())
        self._marks = write_marks(watched)
        self.check_due = step_ends or not torch.is_grad_enabled()

    def wrote_in_place(self) -> bool:
        """Whether this rank's expert parameters were written in place (under ``no_grad``, by a
        load, or their ``p.data`` replaced) since the last forward: host only. Only this rank
        knows; `ExpertPlacement.route` tells the EP group with the counts it gathers anyway."""
        return self._marks is not None and write_marks(self._watched) != self._marks

    def changed(self, expert_params: list[list[torch.Tensor]]) -> bool:
        """Collective over the EP group: whether any held replica's weights differ from its home's
        (``expert_params``: this rank's primary experts' parameters, ``[E_local][n]``), by
        `weight_watch.content_hash` (home's and holder's, one all-reduce, one read on the host)."""
        me, held = self.me, self._held()
        hashes = torch.zeros(len(held), 2, 2 * len(self.weights[0]), dtype=torch.int64, device=self.device)
        for i, (q, j, e) in enumerate(held):
            home, local = self.placement.home_of(e)
            if home == me:
                hashes[i, 0] = content_hash(expert_params[local])
            if q == me:
                hashes[i, 1] = content_hash(self.weights[j])
        if self.placement.ep_group is not None and dist.get_world_size(self.placement.ep_group) > 1:
            dist.all_reduce(hashes, group=self.placement.ep_group)  # each entry has one contributor
        return bool((hashes[:, 0] != hashes[:, 1]).any())

    def held_back_locals(self) -> list[int]:
        """The local indices whose experts' gradients of a step's last micro-batch every rank of the
        EP group holds back to the backward's end (`plan.replicas.held_back_locals`, from the
        replica table, so the same on every rank; none without `holds_back`), ascending: the
        replicas' sums for the experts there travel while the layers below compute."""
        held = self._held()
        if not (self.holds_back and self._engine_backward_seen and held):
            return []
        at = [self.placement.home_of(e) for _, _, e in held]
        return held_back_locals([home for home, _ in at], [local for _, local in at], self.placement.ep_size,
                                len(self.weights)).tolist()

    def _late_pairs(self, held: list[tuple[int, int, int]], held_back: Sequence[int]) -> set:
        """The held (holder, slot, expert) whose sums their home takes when the backward ends: those
        of the experts at the local indices ``held_back``."""
        late = set(held_back)
        return {(q, j, e) for q, j, e in held if self.placement.home_of(e)[1] in late}

    def backward(self, replica_grads: list[list[torch.Tensor]], later: int, held_back: Sequence[int] = ()) -> None:
        """One micro-batch's backward (collective over the EP group where it sends): add the replica
        slots' weight-gradients ``replica_grads`` (``[S][n]``) to the step's fp32 sums. ``later``:
        the micro-batches of the step after this one. With one left and gradients narrower than
        fp32, the sums go home now (`_send_early`; for each home at most as many as it has replica
        slots, the first in holder order: what `memory.replica_bytes` counts); with none, the rest
        goes (`_send_last`): this micro-batch's gradients alone where the sums went early, else the
        sums; `arrived` then gives them. A micro-batch with more to come after an early send (a
        schedule the engine did not announce) takes it back: the holders go on adding to the sums
        they sent, the homes drop theirs. ``held_back``: the local indices whose gradients this
        micro-batch's forward held back (`held_back_locals` then)."""
        self._engine_backward_seen = self.in_engine_backward()
        held = self._held()
        if self._early is not None and later > 0:  # taken back: each sum goes on in the holder's order
            early, self._early = self._early, None
            early.wait(self.device)
            for j, sums in early.sent.items():
                self._sums[j] = sums
        sent_early = self._early.pairs if self._early is not None else set()
        me = self.me
        for q, j, e in held:
            if q == me and (q, j, e) not in sent_early:
                grads = replica_grads[j]
                # in fp32, so that a step's sum is rounded once (as DeepSpeed accumulates a bf16
                # model's gradients), and sent so
                self._sums[j] = ([g.float() for g in grads] if self._sums[j] is None
                                 else [s.add_(g) for s, g in zip(self._sums[j], grads)])
        if later == 1 and self.narrow:
            pairs = self._early_pairs(held)
            if pairs:
                with self.placement.timing_replicas():
                    self._send_early(held, pairs)
                return
        if later > 0:
            return
        with self.placement.timing_replicas():
            self._send_last(held, replica_grads, held_back)

    def sums_here(self) -> list[tuple[int, list[torch.Tensor]]]:
        """After a step's last `backward`, from the layer's backward (every rank): on a home of
        replicated experts whose gradients it does not hold back, `arrived` now (its stream waits
        for that relay: the sums must join the expert's gradient before autograd hands it to
        DeepSpeed); on any other rank nothing, its wait left to the end of the backward (an
        autograd-engine callback), so that its compute goes on while the relay runs and its sent
        tensors are freed after it."""
        if self._last is not None and self._last.arriving:  # sums for this rank's experts in that relay
            return self.arrived()
        last, self._last = self._last, None
        if last is not None:
            torch.autograd.Variable._execution_engine.queue_callback(lambda: last.wait(self.device))
        return []

    def at_backward_end(self, params: list[list[torch.Tensor]], grads: list[list[torch.Tensor]],
                        locals_: list[int]) -> None:
        """From a step's last backward through the layer (every rank, after `backward`), for the
        experts at `held_back_locals` ``locals_``: the delivery of ``grads`` (``[k][n]``, this
        micro-batch's gradients of their parameters ``params``, which autograd was not given) with
        their replicas' sums added where this rank is their home (`with_sum`), by a backward of
        their own into ``params``: they accumulate and run their hooks (DeepSpeed's gradient
        reductions) then, once, in the same order on every rank, as the same local indices are held
        back everywhere. Inside the engine's backward it waits for the running backward's end (an
        autograd-engine callback), so the sums travel while the layers below compute; a layer run
        twice in one forward delivers both runs' gradients in that one backward. Under a direct
        ``loss.backward()`` it is now (DeepSpeed reduces in a callback queued before any of ours),
        and the next steps hold nothing back (`held_back_locals`)."""
        delivery = (params, grads, locals_, self._late)
        self._late = None
        if not self.in_engine_backward():
            self._deliver([delivery])
            return
        self._deliveries.append(delivery)
        if len(self._deliveries) == 1:
            torch.autograd.Variable._execution_engine.queue_callback(self._deliver_queued)

    def _deliver_queued(self) -> None:
        deliveries, self._deliveries = self._deliveries, []
        self._deliver(deliveries)

    def _deliver(self, deliveries: list[tuple]) -> None:
        """`at_backward_end`'s deliveries, each (params, grads, local indices, its `_LastSums`), in
        one backward: a parameter in several adds their gradients first, so that its hooks run once."""
        totals: dict[int, list] = {}  # id(parameter) -> [parameter, gradient]
        for params, grads, locals_, late in deliveries:
            sums = dict(self._take(late))
            for local, group, grad in zip(locals_, params, grads):
                for p, g in zip(group, with_sum(grad, sums.pop(local)) if local in sums else grad):
                    if id(p) in totals:
                        totals[id(p)][1] = totals[id(p)][1] + g
                    else:
                        totals[id(p)] = [p, g]
            if sums:
                raise AssertionError(f"replica sums arrived for local experts {sorted(sums)} whose gradients were "
                                     "not held back")
        torch.autograd.backward([p for p, _ in totals.values()], [g for _, g in totals.values()])
        self.held_back += 1

    def _transfers(self, held, outgoing: Callable[[tuple], list[torch.Tensor]],
                   dtype: Callable[[tuple], Optional[torch.dtype]]) -> tuple[list, list]:
        """`relay`'s transfers of one gradient exchange over ``held`` (holder, slot, expert): each
        pair's ``outgoing(pair)`` from this rank's slots, into fresh buffers of ``dtype(pair)`` (None:
        the weights') on an expert's home. Returns (transfers, [(holder, slot, expert, local index,
        buffers)] of those arriving here)."""
        me, transfers, arriving = self.me, [], []
        for q, j, e in held:
            home, local = self.placement.home_of(e)
            if q == me:
                tensors = outgoing((q, j, e))
            elif home == me:
                tensors = [torch.empty(w.shape, dtype=dtype((q, j, e)) or w.dtype, device=self.device)
                           for w in self.weights[j]]
                arriving.append((q, j, e, local, tensors))
            else:
                tensors = self._shapes(self.weights[j], dtype((q, j, e)))
            transfers.append((q, home, tensors))
        return transfers, arriving

    def _relayed(self, transfers: Callable[[], tuple[list, object]], queued: bool = True) -> tuple[object, object]:
        """`relay` the transfers that ``transfers()`` returns, beside what the caller keeps of them
        (buffers allocated there belong to the stream the relay runs on): where ``queued`` and the
        slots are on a CUDA device, on `relay_stream`, after the caller's stream's work so far (the
        tensors sent are computed, the slots written are no longer read). Returns (what the caller
        keeps, the CUDA event after the relay; None where it ran in the caller's order)."""
        stream = relay_stream(self.device) if queued else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with on_stream(stream):
            out, kept = transfers()
            relay(out, self.me, self.placement.ranks_per_node, self._peer, self.device)
            done = torch.cuda.Event() if stream is not None else None
            if done is not None:
                done.record(stream)
        return kept, done

    def _early_pairs(self, held: list[tuple[int, int, int]]) -> set:
        """The held (holder, slot, expert) whose sums go early (`plan.replicas.early_sums`: for each
        home, its first replicas in holder order, as many as it has replica slots). The same on
        every rank."""
        early = early_sums([self.placement.home_of(e)[0] for _, _, e in held], len(self.weights))
        return {pair for pair, sends in zip(held, early) if sends}

    def _send_early(self, held: list[tuple[int, int, int]], pairs: set) -> None:
        """`backward` a micro-batch before the step's end: the sums so far of ``pairs`` go home
        (collective), on `relay_stream` where the slots are on a CUDA device, so that they travel
        while the last micro-batch computes; the home keeps them until the step's last backward
        (`_send_last`)."""
        early = [pair for pair in held if pair in pairs]
        arriving, done = self._relayed(lambda: self._transfers(early, lambda pair: self._sums[pair[1]],
                                                               lambda pair: torch.float32))
        sent = {j: self._sums[j] for q, j, _ in early if q == self.me}
        self.early_sends += len(sent)
        self._early = _EarlySums({(q, j, e): (local, tensors) for q, j, e, local, tensors in arriving}, sent,
                                 set(early), done)
        for j in sent:
            self._sums[j] = None

    def _send_last(self, held: list[tuple[int, int, int]], replica_grads: list[list[torch.Tensor]],
                   held_back: Sequence[int]) -> None:
        """`backward` at the step's end (collective): each held replica's fp32 sum goes home, or,
        where the sum before went early, this micro-batch's ``replica_grads`` alone, in their own
        dtype; on a CUDA device queued on `relay_stream`, so the layer's backward goes on. `arrived`
        waits for them."""
        me = self.me
        early, self._early = self._early, None
        sent_early = early.pairs if early is not None else set()
        def exchange(pairs: list) -> _LastSums:
            outgoing = {}  # this rank's sent tensors, held until this relay is through
            arriving, done = self._relayed(lambda: self._transfers(
                pairs, lambda pair: outgoing.setdefault(pair, list(replica_grads[pair[1]]) if pair in sent_early
                                                        else self._sums[pair[1]]),
                lambda pair: None if pair in sent_early else torch.float32))
            return _LastSums(early, arriving, outgoing, done, set(pairs))

        # the sums their homes take in the layer's backward first, then those held back to its end
        late = self._late_pairs(held, held_back)
        self._last = exchange([pair for pair in held if pair not in late])
        self._late = exchange([pair for pair in held if pair in late]) if late else None
        self.grad_sends += sum(q == me for q, _, _ in held)
        self._sums = [None] * len(self.weights)

    def arrived(self) -> list[tuple[int, list[torch.Tensor]]]:
        """After a step's last `backward`, on every rank (the caller's stream waits for its relay):
        on an expert's home, ``(local index, fp32 sums [n])`` per replicated expert, its replicas'
        sums added in holder-rank order, a holder's early sum and last gradient first (in fp32, as
        the holder would have: the same sum, bit for bit), for `with_sum`; else nothing."""
        last, self._last = self._last, None
        return self._take(last)

    def _take(self, last: Optional["_LastSums"]) -> list[tuple[int, list[torch.Tensor]]]:
        """`arrived` of one relay of the step's last exchange (its pairs' early sums with it)."""
        if last is None:
            return []
        last.wait(self.device)
        early, arriving = last.early, last.arriving
        parts = {}  # (holder, slot, expert) -> (local index, fp32 sums [n]): each holder's step sum
        if early is not None:
            early.wait(self.device)
            # taken out, so that the other relay's `_LastSums` does not keep them to the backward's end
            parts = {pair: early.arrived.pop(pair) for pair in [p for p in early.arrived if p in last.pairs]}
        for q, j, e, local, tensors in arriving:
            if (q, j, e) in parts:  # the holder's order: the early sum, then the last gradient (added in fp32)
                parts[(q, j, e)] = (local, [a.add_(b) for a, b in zip(parts[(q, j, e)][1], tensors)])
            else:
                parts[(q, j, e)] = (local, [t.float() for t in tensors])
        summed: dict[int, list[torch.Tensor]] = {}  # an expert with several replicas: one sum, rounded once
        for key in sorted(parts):
            local, sums = parts[key]
            summed[local] = [a.add_(b) for a, b in zip(summed[local], sums)] if local in summed else sums
        return list(summed.items())

    def end_step(self) -> None:
        """At the optimizer step: a replica gradient sum still here did not reach its expert (the
        step's last micro-batch ran no backward through the layer, or ran one that did not end
        the step): it is dropped, with a warning, rather than added to the next step's."""
        if self._last is not None or self._late is not None:  # sent, and never taken: no gradient waited for them
            warnings.warn("FEPLB: replica gradient sums reached their experts' homes but no backward took them before "
                          "the optimizer step; they are dropped", RuntimeWarning, stacklevel=2)
            self.arrived()
            late, self._late = self._late, None
            self._take(late)
        lost = [j for j, sums in enumerate(self._sums) if sums is not None]
        if lost or self._early is not None:
            warnings.warn(f"FEPLB: the gradients of replica slot(s) {lost or 'sent early'} did not reach their experts "
                          "before the optimizer step (its last micro-batch ran no backward through this MoE layer); "
                          "they are dropped", RuntimeWarning, stacklevel=2)
            if self._early is not None:
                self._early.wait(self.device)  # its buffers may be freed once the relay is through
            self._sums, self._early = [None] * len(self.weights), None


class _EarlySums:
    """The step's replica gradient sums sent a micro-batch before its end (`ReplicaSlots._send_early`),
    until the last backward: ``arrived`` {(holder, slot, expert): (local index, fp32 sums [n])} on
    the experts' home; ``sent`` {slot: fp32 sums [n]}, this rank's sent sums, held until the relay
    is through (and taken back by a micro-batch after the early send); ``pairs``, the (holder,
    slot, expert) sent, the same on every rank; ``done``, the CUDA event after the relay (None: it
    ran in the caller's order)."""

    def __init__(self, arrived: dict, sent: dict, pairs: set, done):
        self.arrived, self.sent, self.pairs, self.done = arrived, sent, pairs, done

    def wait(self, device: torch.device) -> None:
        """The caller's stream waits for the relay (the sums read after it, the sent tensors freed),
        and the arrived sums, allocated on `relay_stream`, are marked as used on it."""
        if self.done is None:
            return
        stream = torch.cuda.current_stream(device)
        stream.wait_event(self.done)
        for _, sums in self.arrived.values():
            for t in sums:
                t.record_stream(stream)


class _LastSums:
    """One relay of a step's last gradient exchange (`ReplicaSlots._send_last`) until it is taken
    (`ReplicaSlots.arrived`, `at_backward_end`): ``early``, the step's `_EarlySums` (None: none
    went early); ``arriving`` [(holder, slot, expert, local index, buffers)] on an expert's home;
    ``outgoing`` this rank's sent tensors, held until the relay is through; ``done``, the CUDA
    event after the relay (None: it ran in the caller's order); ``pairs`` the (holder, slot,
    expert) it carries."""

    def __init__(self, early: Optional[_EarlySums], arriving: list, outgoing: dict, done, pairs: set):
        self.early, self.arriving, self.outgoing, self.done, self.pairs = early, arriving, outgoing, done, pairs

    def wait(self, device: torch.device) -> None:
        """The caller's stream waits for the relay; the arrived buffers, allocated on `relay_stream`,
        are marked as used on it, and the sent tensors let go (their memory is reused after the wait)."""
        if self.done is not None:
            stream = torch.cuda.current_stream(device)
            stream.wait_event(self.done)
            for *_, tensors in self.arriving:
                for t in tensors:
                    t.record_stream(stream)
        self.outgoing = {}


def relay_stream(device: torch.device) -> Optional[torch.cuda.Stream]:
    """Where `ReplicaSlots` queues its relays on a CUDA device (the stepped weights at the engine's
    forward, a step's early and last gradient halves): one stream per device and process, so that
    the compute stream goes on while the relay's rounds wait for each other (a relay waits for each
    round's transfers on the stream it runs on), waiting for it only where it needs what the relay
    brings; None on host memory (the relay runs in the caller's order)."""
    if device.type != "cuda":
        return None
    return _relay_stream(cuda_index(device))


@functools.lru_cache(maxsize=None)
def _relay_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=index)
