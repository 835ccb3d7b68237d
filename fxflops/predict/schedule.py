"""A pipeline schedule simulated micro-batch by micro-batch: GPipe, 1F1B and interleaved 1F1B, and
DeepSpeed's pipeline engine instruction by instruction (`simulate_deepspeed`).

The model is cut into `p * v` chunks in model order; chunk `c` lives on pipeline rank `c % p` (Megatron's
interleaved placement: with v = 1 it is simply stage c on rank c). Each rank runs its chunks' forward and
backward passes in the order its schedule prescribes; a pass starts when its rank is free and its input
is there: a forward when the previous chunk's forward of the same micro-batch has ended and its
activations have crossed the link (`p2p` seconds), a backward when the next chunk's backward has ended
and its gradient has crossed back (the last chunk's backward right after its own forward). Nothing
else is assumed: the bubble, every rank's idle time, is what comes out of the simulation, not a formula.

DeepSpeed's PipelineEngine (v0.5.x) runs the same 1F1B order differently: each rank executes the
instruction stream of DeepSpeed's TrainSchedule, step by step (receive / send, then the pass), and every
send and receive is a blocking `dist.send` / `dist.recv` of one tensor (its p2p.py asserts async_op=False),
so a transfer starts only when both ranks have reached it and holds both until it has crossed
(`simulate_deepspeed`).

Times are seconds (any unit works: the simulation only adds and compares them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

GPIPE = "gpipe"
ONE_F_ONE_B = "1f1b"
INTERLEAVED = "interleaved"
SCHEDULES = (GPIPE, ONE_F_ONE_B, INTERLEAVED)

FORWARD = "forward"
BACKWARD = "backward"
COMPUTE = "compute"
P2P = "p2p"


@dataclass(frozen=True)
class ChunkCost:
    """One model chunk's time per micro-batch: its forward, its backward (recomputation included), and the
    time its output activations (forward) / input gradients (backward) take to reach the neighbouring rank;
    `accumulate`: what each backward but the first micro-batch's adds, adding its gradients into those the
    step's earlier micro-batches left (torch's AccumulateGrad once a parameter's .grad exists)."""

    forward: float
    backward: float
    p2p: float = 0.0
    accumulate: float = 0.0


class Event(NamedTuple):
    """One pass of one chunk for one micro-batch on one rank (stream COMPUTE), or one transfer (stream P2P,
    on the sending rank). A named tuple: a search simulates hundreds of thousands of them."""

    rank: int
    kind: str  # FORWARD | BACKWARD | "send forward" | "send backward"
    microbatch: int
    chunk: int  # the model chunk (0 .. p*v-1)
    start: float
    end: float
    stream: str = COMPUTE


@dataclass
class Timeline:
    """What the simulation found: every event, per rank; the step's end; and each rank's idle time."""

    schedule: str
    stages: int  # p, the pipeline ranks
    virtual_stages: int  # v, chunks per rank
    microbatches: int  # m
    by_rank: list[list[Event]] = field(default_factory=list)  # each rank's events, in the order they ran
    step_time: float = 0.0  # the last backward's end on any rank
    # each compute event's cause: the event whose end let it start (its rank's previous pass, or the pass whose
    # output it waited for), None at the start of the step
    causes: dict[Event, Event | None] = field(default_factory=dict, repr=False)

    def critical_path(self) -> list[Event]:
        """The chain of passes that sets the step time, first to last: from the pass that ends last, back
        through whatever each one waited for (a transfer's time lies between a pass and its cause)."""
        ends = [e for events in self.by_rank for e in events if e.stream == COMPUTE]
        if not ends:
            return []
        path = [max(ends, key=lambda e: e.end)]
        while (cause := self.causes.get(path[-1])) is not None:
            path.append(cause)
        return path[::-1]

    @property
    def events(self) -> list[Event]:
        """Every event, rank by rank."""
        return [e for events in self.by_rank for e in events]

    def busy(self, rank: int) -> float:
        """Compute time of one rank (its passes' durations)."""
        return sum(e.end - e.start for e in self.by_rank[rank] if e.stream == COMPUTE)

    def bubble(self, rank: int) -> float:
        """Idle time of one rank within the step: step time minus its compute."""
        return self.step_time - self.busy(rank)

    @property
    def ideal(self) -> float:
        """The step without any bubble: the busiest rank's compute."""
        return max(self.busy(rank) for rank in range(self.stages))

    @property
    def bubble_time(self) -> float:
        """The step's bubble: step time minus the busiest rank's compute."""
        return self.step_time - self.ideal

    @property
    def bubble_fraction(self) -> float:
        """The bubble as a fraction of the ideal step (uniform stages: (p-1)/(m*v))."""
        return self.bubble_time / self.ideal if self.ideal else 0.0

    def in_flight(self, rank: int, chunk: int | None = None, weights: Sequence[int] | None = None) -> int:
        """The most micro-batch chunks whose forward has run on `rank` and whose backward has not yet
        ended: how many chunks' activations the rank holds at once (1F1B's first stage: p); of model chunk
        `chunk` only, when given (the first chunk's, which carries the embedding; the last's, the head). `weights`
        (per model chunk, its layers): each chunk counted by its weight, the most layer-micro-batches held at once
        (chunks of uneven depth are not in flight equally often)."""
        marks = []
        for e in self.by_rank[rank]:
            if e.stream == COMPUTE and (chunk is None or e.chunk == chunk):
                # a forward holds its activations from its start; a backward frees them at its end
                weight = weights[e.chunk] if weights is not None else 1
                marks.append((e.start, weight) if e.kind == FORWARD else (e.end, -weight))
        most = live = 0
        for _, change in sorted(marks, key=lambda mark: (mark[0], mark[1])):
            live += change
            most = max(most, live)
        return most

    def rank_events(self, rank: int) -> list[Event]:
        return self.by_rank[rank]


def order(schedule: str, stages: int, microbatches: int, virtual_stages: int, rank: int) -> list[tuple[str, int, int]]:
    """The passes rank `rank` runs, in order: (FORWARD | BACKWARD, micro-batch, chunk)."""
    p, m, v = stages, microbatches, virtual_stages
    chunks = [rank + p * k for k in range(v)]  # the chunks on this rank, model order
    if schedule == GPIPE:
        # every forward (chunk by chunk, micro-batch by micro-batch), then every backward in reverse
        forwards = [(FORWARD, mb, c) for c in chunks for mb in range(m)]
        backwards = [(BACKWARD, mb, c) for c in reversed(chunks) for mb in range(m)]
        return forwards + backwards
    if schedule == ONE_F_ONE_B and v == 1:
        warmup = min(p - rank - 1, m)
        passes = [(FORWARD, mb, rank) for mb in range(warmup)]
        for i in range(m - warmup):
            passes += [(FORWARD, warmup + i, rank), (BACKWARD, i, rank)]
        passes += [(BACKWARD, mb, rank) for mb in range(m - warmup, m)]
        return passes
    # Megatron-LM's interleaved 1F1B (forward_backward_pipelining_with_interleaving): the k-th forward of a
    # rank is chunk (k // p) % v of micro-batch (k // (p*v)) * p + k % p; backwards walk the chunks backwards
    total = m * v

    def forward(k: int) -> tuple[str, int, int]:
        return FORWARD, (k // (p * v)) * p + k % p, chunks[(k // p) % v]

    def backward(k: int) -> tuple[str, int, int]:
        return BACKWARD, (k // (p * v)) * p + k % p, chunks[v - 1 - (k // p) % v]

    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    passes = [forward(k) for k in range(warmup)]
    for i in range(total - warmup):
        passes += [forward(warmup + i), backward(i)]
    passes += [backward(k) for k in range(total - warmup, total)]
    return passes


def check(schedule: str, stages: int, microbatches: int, virtual_stages: int) -> None:
    """One clear ValueError for a schedule that cannot run."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r}: pick one of {', '.join(SCHEDULES)}")
    if min(stages, microbatches, virtual_stages) < 1:
        raise ValueError(f"pipeline schedule: stages={stages}, micro-batches={microbatches} and "
                         f"virtual_stages={virtual_stages} must each be >= 1")
    if schedule == ONE_F_ONE_B and virtual_stages > 1:
        raise ValueError(f"pipeline schedule '1f1b' runs one chunk per rank; with virtual_stages="
                         f"{virtual_stages} use 'interleaved'")
    if schedule == INTERLEAVED and stages > 1 and microbatches % stages:
        raise ValueError(f"interleaved 1F1B needs the micro-batches ({microbatches}) to be a multiple of the "
                         f"pipeline stages ({stages}), as Megatron-LM does; pick another micro-batch count")


def simulate(chunks: Sequence[ChunkCost], microbatches: int, schedule: str = ONE_F_ONE_B,
             stages: int | None = None) -> Timeline:
    """Simulate one step of a pipeline of `len(chunks)` chunks (model order) over `stages` ranks (default:
    one chunk per rank; v = len(chunks) / stages chunks per rank, placed round robin) for `microbatches`."""
    p = len(chunks) if stages is None else stages
    if p < 1 or len(chunks) % p:
        raise ValueError(f"pipeline: {len(chunks)} chunks do not split over {p} stages evenly")
    v = len(chunks) // p
    if schedule == INTERLEAVED and v == 1:
        schedule = ONE_F_ONE_B  # interleaving one chunk per rank is 1F1B
    check(schedule, p, microbatches, v)
    m, n = microbatches, len(chunks)
    queues = [order(schedule, p, m, v, rank) for rank in range(p)]
    position = [0] * p
    free = [0.0] * p
    done: dict[tuple[str, int, int], Event] = {}  # (kind, micro-batch, chunk) -> its event
    last: list[Event | None] = [None] * p  # each rank's latest pass
    timeline = Timeline(schedule, p, v, m, [[] for _ in range(p)])
    remaining = sum(len(q) for q in queues)
    while remaining:
        progressed = False
        for rank in range(p):
            while position[rank] < len(queues[rank]):
                kind, mb, c = queues[rank][position[rank]]
                waited = _ready(kind, mb, c, n, chunks, done)
                if waited is None:
                    break
                ready, needed = waited
                start = max(free[rank], ready)
                cost = _cost(chunks[c], kind, mb)
                end = start + cost
                event = Event(rank, kind, mb, c, start, end)
                timeline.by_rank[rank].append(event)
                timeline.causes[event] = needed if needed is not None and ready >= free[rank] else last[rank]
                _send(timeline, kind, mb, c, n, p, chunks, end)
                done[(kind, mb, c)] = last[rank] = event
                free[rank] = end
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # an order that waits on itself: a bug in `order`, never a user's input
            raise RuntimeError(f"pipeline schedule {schedule} deadlocked (p={p}, m={m}, v={v})")
    timeline.step_time = max(free)
    return timeline


RECV_ACTIVATION, SEND_GRAD, SEND_ACTIVATION, RECV_GRAD = "recv activation", "send grad", "send activation", "recv grad"


def deepspeed_instructions(stages: int, microbatches: int, stage: int) -> list[tuple[str, int]]:
    """The instructions stage `stage` executes in one step of DeepSpeed's TrainSchedule (deepspeed/runtime/pipe/
    schedule.py, v0.5.x), as (FORWARD | BACKWARD | RECV_ACTIVATION | SEND_GRAD | SEND_ACTIVATION | RECV_GRAD,
    micro-batch): 2 (m + p - 1) steps; in step t an even stage runs a forward when t is even and a backward when
    it is odd (an odd stage the other way round), of the micro-batch `_step_to_micro_batch` names; a forward
    step first receives that micro-batch's activations and sends the previous step's input gradient, a backward
    step first sends the previous step's activations and receives that micro-batch's output gradient."""
    p, m, s = stages, microbatches, stage
    out: list[tuple[str, int]] = []
    previous = -1
    for step in range(2 * (m + p - 1)):
        forward = step % 2 == s % 2
        if forward:
            mb = (step if step % 2 == 0 else step - 1) // 2 - s // 2
        elif step % 2 == 0:
            mb = step // 2 - p + (s + 1) // 2
        else:
            mb = (step - 1) // 2 - p + 1 + s // 2
        valid, valid_previous = 0 <= mb < m, 0 <= previous < m
        if forward and s > 0:
            out += [(RECV_ACTIVATION, mb)] if valid else []
            out += [(SEND_GRAD, previous)] if valid_previous else []
        elif not forward and s < p - 1:
            out += [(SEND_ACTIVATION, previous)] if valid_previous else []
            out += [(RECV_GRAD, mb)] if valid else []
        if valid:
            out.append((FORWARD if forward else BACKWARD, mb))
        previous = mb
    return out


# each transfer instruction: the peer's stage offset and the instruction it pairs with
_PAIRS = {SEND_ACTIVATION: (1, RECV_ACTIVATION), RECV_ACTIVATION: (-1, SEND_ACTIVATION),
          SEND_GRAD: (-1, RECV_GRAD), RECV_GRAD: (1, SEND_GRAD)}


def simulate_deepspeed(chunks: Sequence[ChunkCost], microbatches: int) -> Timeline:
    """One step of DeepSpeed's pipeline engine over `len(chunks)` stages (one chunk a stage: DeepSpeed does not
    interleave), each stage running `deepspeed_instructions` in order. A pass runs when its rank gets to it; a
    send and its receive pair up when both ranks have reached them (a blocking dist.send / dist.recv) and hold
    both ranks for the sender's `p2p` seconds. Returns the Timeline (passes, and each transfer as a P2P event
    on its sender)."""
    p, m = len(chunks), microbatches
    check(ONE_F_ONE_B, p, m, 1)
    programs = [deepspeed_instructions(p, m, s) for s in range(p)]
    position = [0] * p
    free = [0.0] * p
    last: list[Event | None] = [None] * p  # each rank's latest pass
    waited: list[Event | None] = [None] * p  # the pass on another rank that a transfer made this rank wait for
    timeline = Timeline(ONE_F_ONE_B, p, 1, m, [[] for _ in range(p)])
    remaining = sum(len(program) for program in programs)
    while remaining:
        progressed = False
        for s in range(p):
            while position[s] < len(programs[s]):
                kind, mb = programs[s][position[s]]
                if kind in (FORWARD, BACKWARD):
                    cost = _cost(chunks[s], kind, mb)
                    event = Event(s, kind, mb, s, free[s], free[s] + cost)
                    timeline.by_rank[s].append(event)
                    timeline.causes[event] = waited[s] if waited[s] is not None else last[s]
                    last[s], waited[s] = event, None
                    free[s] = event.end
                    position[s] += 1
                    remaining -= 1
                    progressed = True
                    continue
                offset, pair = _PAIRS[kind]
                peer = s + offset
                if position[peer] >= len(programs[peer]) or programs[peer][position[peer]] != (pair, mb):
                    break  # blocked until the peer reaches the matching instruction
                sender, sending = (s, kind) if kind in (SEND_ACTIVATION, SEND_GRAD) else (peer, pair)
                start = max(free[s], free[peer])
                end = start + chunks[sender].p2p
                if chunks[sender].p2p:
                    name = "send forward" if sending == SEND_ACTIVATION else "send backward"
                    timeline.by_rank[sender].append(Event(sender, name, mb, sender, start, end, P2P))
                for rank, other in ((s, peer), (peer, s)):  # the later of the two set when both go on
                    if free[other] > free[rank] and last[other] is not None:
                        waited[rank] = last[other]
                free[s] = free[peer] = end
                position[s] += 1
                position[peer] += 1
                remaining -= 2
                progressed = True
        if not progressed:  # DeepSpeed's own schedule never waits on itself: a bug here, never a user's input
            raise RuntimeError(f"DeepSpeed pipeline schedule deadlocked (p={p}, m={m})")
    timeline.step_time = max(free)
    return timeline


def _cost(chunk: ChunkCost, kind: str, mb: int) -> float:
    """One pass's time: the forward; the backward, plus its gradient accumulation after micro-batch 0."""
    if kind == FORWARD:
        return chunk.forward
    return chunk.backward + (chunk.accumulate if mb else 0.0)


def _ready(kind: str, mb: int, c: int, n: int, chunks: Sequence[ChunkCost], done: dict
           ) -> tuple[float, Event | None] | None:
    """(when the input of a pass is on its rank, the pass it came from); None while that pass has not run."""
    if kind == FORWARD:
        if c == 0:
            return 0.0, None
        before = done.get((FORWARD, mb, c - 1))
        return None if before is None else (before.end + chunks[c - 1].p2p, before)
    if c == n - 1:
        own = done.get((FORWARD, mb, c))
        return None if own is None else (own.end, own)
    after = done.get((BACKWARD, mb, c + 1))
    return None if after is None else (after.end + chunks[c + 1].p2p, after)


def _send(timeline: Timeline, kind: str, mb: int, c: int, n: int, p: int, chunks: Sequence[ChunkCost],
          end: float) -> None:
    """The transfer a pass ends with, as a P2P event on the sending rank (none past either end)."""
    if kind == FORWARD and c < n - 1 and chunks[c].p2p:
        timeline.by_rank[c % p].append(Event(c % p, "send forward", mb, c, end, end + chunks[c].p2p, P2P))
    elif kind == BACKWARD and c > 0 and chunks[c].p2p:
        timeline.by_rank[c % p].append(Event(c % p, "send backward", mb, c, end, end + chunks[c].p2p, P2P))
