"""Pipeline schedules as data: which action each stage takes at each tick, made from each
stage's order of actions, checked, and summarised (bubble, microbatches in flight, a drawing).

An action is (kind, microbatch, virtual stage j): F runs the forward of layer chunk j on a
microbatch, B its backward (with the weight gradient, or without it when the schedule splits
W off, as zero-bubble schedules do), W the weight gradient alone. Virtual stage j lives on
stage j % P as its chunk j // P (V chunks per stage: interleaved schedules). One action takes
one tick; what an action sends (an F's output, a B's input gradient) reaches the neighbouring
stage at the next tick.

A schedule starts as each stage's order of actions (`orders`, or a file of them). `simulate`
places them in ticks: each stage takes its next action as soon as what it needs is done (a W
may fill a tick where the next action must wait). The resulting `Table` is checked (`check`)
before the executor (parallel.executor) runs it. Pure numpy: no JAX here.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import re

import numpy as np

from jaxscale.names import BUILT_IN_SCHEDULES

IDLE, F, B, W = 0, 1, 2, 3
LETTERS = {IDLE: ".", F: "F", B: "B", W: "W"}
ACTIONS = "pipeline_actions"  # the name scope of the executor's switch over a tick's action kinds

Action = tuple[int, int, int]  # (kind, microbatch, virtual stage)


class ScheduleError(ValueError):
    """A schedule that cannot run: what is wrong, in one line."""


@dataclasses.dataclass(frozen=True)
class Table:
    """kind, microbatch and virtual stage of each (tick, stage): int arrays [T, P]."""

    kind: np.ndarray
    micro: np.ndarray
    vstage: np.ndarray
    stages: int
    microbatches: int
    virtual: int

    @property
    def ticks(self) -> int:
        return self.kind.shape[0]

    @property
    def split_backward(self) -> bool:
        """Whether W runs apart from B (B then computes the input gradient only)."""
        return bool((self.kind == W).any())

    def times(self) -> dict[Action, int]:
        """The tick of every action."""
        return {(int(self.kind[t, s]), int(self.micro[t, s]), int(self.vstage[t, s])): t
                for t, s in zip(*np.nonzero(self.kind))}

    def bubble(self) -> float:
        """Share of stage-ticks idle, with F, B and W costing one tick each."""
        return float((self.kind == IDLE).mean())

    def shares(self) -> tuple[float, ...]:
        """Share of stage-ticks of each kind, in the order IDLE, F, B, W."""
        return tuple(float((self.kind == k).mean()) for k in (IDLE, F, B, W))

    def in_flight(self) -> np.ndarray:
        """[P]: the most microbatch-chunks each stage holds at once: F done (its input kept),
        last backward action (B, or W when split) not yet done."""
        last, ticks = W if self.split_backward else B, np.arange(self.ticks)
        peak = np.zeros(self.stages, int)
        for s in range(self.stages):
            starts, ends = (np.nonzero(self.kind[:, s] == k)[0] for k in (F, last))  # ticks, ascending
            peak[s] = (np.searchsorted(starts, ticks, "right") - np.searchsorted(ends, ticks, "left")).max()
        return peak

    def draw(self) -> str:
        """Stages x ticks, one character per action (F, B, W, . idle)."""
        return "\n".join(f"stage {s}: " + "".join(LETTERS[int(k)] for k in self.kind[:, s])
                         for s in range(self.stages))


def orders(name: str, stages: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    """Each stage's order of actions for a named schedule."""
    P, M, V = stages, microbatches, virtual
    if name in ("gpipe", "circular"):
        return [[(F, m, j) for m, j in _interleaved(s, P, M, V, False)]
                + [(B, m, j) for m, j in _interleaved(s, P, M, V, True)] for s in range(P)]
    if name in ("1f1b", "interleaved_1f1b"):
        return [_one_f_one_b(s, P, M, V) for s in range(P)]
    if name == "zero_bubble":
        return [_one_f_one_b(s, P, M, 1) for s in range(P)]
    raise ScheduleError(f"no schedule named {name!r}; choose one of {', '.join(BUILT_IN_SCHEDULES)}")


def _interleaved(s: int, P: int, M: int, V: int, backward: bool) -> list[tuple[int, int]]:
    """(microbatch, virtual stage) in Megatron's interleaved order on stage s: microbatches in
    groups of P, each group through chunk 0, then chunk 1, ... (backward: the last chunk first)."""
    out = []
    for k in range(M * V):
        group, within = divmod(k, P * V)
        chunk = within // P
        micro = group * P + within % P
        if micro >= M:
            continue
        out.append((micro, (V - 1 - chunk if backward else chunk) * P + s))
    if len(out) < M * V:  # M not a multiple of P: the rest in plain order
        seen = set(out)
        out += [(m, (V - 1 - c if backward else c) * P + s) for c in range(V) for m in range(M)
                if (m, (V - 1 - c if backward else c) * P + s) not in seen]
    return out


def _one_f_one_b(s: int, P: int, M: int, V: int) -> list[Action]:
    """1F1B on stage s: warm-up forwards, then one forward and one backward in turn, then the
    remaining backwards. Interleaved (V > 1): Megatron's warm-up of 2(P-s-1) + (V-1)P."""
    forwards, backwards = _interleaved(s, P, M, V, False), _interleaved(s, P, M, V, True)
    warm = min((P - s - 1) * 2 + (V - 1) * P if V > 1 else P - s - 1, M * V)
    out = [(F, m, j) for m, j in forwards[:warm]]
    for i, (m, j) in enumerate(forwards[warm:]):
        out += [(F, m, j), (B, *backwards[i])]
    return out + [(B, m, j) for m, j in backwards[len(forwards) - warm:]]


def simulate(stage_orders: list[list[Action]], stages: int, microbatches: int, virtual: int,
             split_backward: bool = False) -> Table:
    """Place each stage's actions in ticks: a stage takes its next action once what it needs is
    done at an earlier tick (W actions the orders name are taken in their turn, like any other).
    With split_backward, each B is followed by its W, which waits in a
    queue and runs when the stage would otherwise idle, or when more than P-1-s are queued
    (ZB-H1: the held inputs stay as 1F1B's), and at the end."""
    P = stages
    done: dict[Action, int] = {}
    pending = [list(o) for o in stage_orders]
    queued: list[list[Action]] = [[] for _ in range(P)]
    rows = []
    for t in range(10 * (sum(len(o) for o in pending) + P)):
        if not any(pending) and not any(queued):
            break
        row = []
        for s in range(P):
            action = None
            ready = pending[s] and _ready(pending[s][0], done, t, P * virtual)
            if queued[s] and (not ready or len(queued[s]) > P - 1 - s):
                action = queued[s].pop(0)
            elif ready:
                action = pending[s].pop(0)
                if split_backward and action[0] == B:
                    queued[s].append((W, action[1], action[2]))
            row.append(action)
        for action in row:
            if action is not None:
                done[action] = t
        rows.append(row)
    else:
        raise _deadlock(pending)
    return _table(rows, stages, microbatches, virtual)


def _ready(action: Action, done: dict[Action, int], t: int, last: int) -> bool:
    """Whether everything `action` needs is done before tick t (last: the virtual stage count)."""
    kind, m, j = action
    needs = {F: [(F, m, j - 1)] if j else [],
             B: [(F, m, j)] + ([(B, m, j + 1)] if j < last - 1 else []),
             W: [(B, m, j)]}[kind]
    return all(need in done and done[need] < t for need in needs)


def _table(rows, stages: int, microbatches: int, virtual: int) -> Table:
    shape = (len(rows), stages)
    kind, micro, vstage = (np.zeros(shape, np.int32) for _ in range(3))
    for t, row in enumerate(rows):
        for s, action in enumerate(row):
            if action is not None:
                kind[t, s], micro[t, s], vstage[t, s] = action
    return Table(kind, micro, vstage, stages, microbatches, virtual)


def check(table: Table) -> None:
    """Every action exactly once on its own stage, and everything it needs done at an earlier
    tick (its input sent by then: each send has one receiver, the action that needs it)."""
    P, M, V = table.stages, table.microbatches, table.virtual
    kinds = (F, B, W) if table.split_backward else (F, B)
    want = {(k, m, j) for k in kinds for m in range(M) for j in range(P * V)}
    seen: list[Action] = []
    for t, s in zip(*np.nonzero(table.kind)):
        action = (int(table.kind[t, s]), int(table.micro[t, s]), int(table.vstage[t, s]))
        if action[2] % P != s:
            raise ScheduleError(f"{_name(action, s)} is on stage {s}, but virtual stage {action[2]} lives on "
                                f"stage {action[2] % P}")
        seen.append(action)
    if len(seen) != len(set(seen)) or set(seen) != want:
        extra = sorted(set(seen) - want) or [a for a in seen if seen.count(a) > 1]
        missing = sorted(want - set(seen))
        raise ScheduleError("the schedule must run each action once: "
                            + (f"missing {_name(missing[0])}" if missing else f"unexpected {_name(extra[0])}"))
    times = table.times()
    for action, t in times.items():
        if not _ready(action, times, t, P * V):
            raise ScheduleError(f"{_name(action)} at tick {t} comes before what it needs")


def _name(action: Action, stage: int | None = None) -> str:
    """As written in a schedule file: F3, or F3@5 where the virtual stage is not the stage's own."""
    kind, m, j = action
    return f"{LETTERS[kind]}{m}" + ("" if j == stage else f"@{j}")


@functools.lru_cache(maxsize=64)
def build(name: str, stages: int, microbatches: int, virtual: int = 1) -> Table:
    """The checked table of a named schedule (built once per shape: each trace of the step and
    each plan asks again; treat it as read-only)."""
    table = simulate(orders(name, stages, microbatches, virtual), stages, microbatches, virtual,
                     split_backward=name == "zero_bubble")
    check(table)
    return table


_ACTION = re.compile(r"([FBW])(\d+)(?:@(\d+))?$")


def load(path: str, stages: int, microbatches: int, virtual: int = 1) -> Table:
    """A schedule from a file: one line per stage, `stage S:` optional, then its actions in order,
    e.g. `F0 F1 B0 F2 B1 B2`; `F3@5` names virtual stage 5 (default: the stage itself). W
    actions split the backward (then every B needs its W). Checked like the named ones."""
    lines = [line.split("#")[0].strip() for line in pathlib.Path(path).read_text().splitlines()]
    lines = [re.sub(r"^stage\s+\d+\s*:", "", line).split() for line in lines if line]
    if len(lines) != stages:
        raise ScheduleError(f"{path} has {len(lines)} stage lines; the mesh has {stages} pipeline stages")
    stage_orders = []
    for s, words in enumerate(lines):
        actions = []
        for word in words:
            match = _ACTION.match(word)
            if match is None:
                raise ScheduleError(f"{path}, stage {s}: {word!r} is not an action like F0, B3 or W2@5")
            kind = {"F": F, "B": B, "W": W}[match.group(1)]
            actions.append((kind, int(match.group(2)), int(match.group(3) or s)))
        stage_orders.append(actions)
    split = any(a[0] == W for o in stage_orders for a in o)
    _complete(stage_orders, stages, microbatches, virtual, split)
    table = simulate(stage_orders, stages, microbatches, virtual)
    check(table)
    return table


def _complete(stage_orders, stages: int, microbatches: int, virtual: int, split: bool) -> None:
    """Each stage lists every action of its virtual stages once."""
    for s, actions in enumerate(stage_orders):
        want = {(k, m, j) for k in ((F, B, W) if split else (F, B)) for m in range(microbatches)
                for j in range(s, stages * virtual, stages)}
        missing, extra = sorted(want - set(actions)), sorted({a for a in actions if a not in want or
                                                              actions.count(a) > 1})
        if missing or extra:
            what = (f"misses {_name(missing[0], s)}" if missing else
                    f"has {_name(extra[0], s)} once too often or out of range")
            raise ScheduleError(f"stage {s} {what}: each stage lists F and B{' and W' if split else ''} of each "
                                f"microbatch 0..{microbatches - 1} for each of its virtual stages once")


def _deadlock(pending) -> ScheduleError:
    stuck = ", ".join(f"stage {s} waits forever at {_name(o[0], s)}" for s, o in enumerate(pending) if o)
    return ScheduleError(f"the schedule deadlocks: {stuck}")
