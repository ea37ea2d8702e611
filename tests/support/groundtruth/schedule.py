"""Randomized schedules of saves: pure, seeded, so any failure is reproduced by its seed.

A schedule is a list of rounds run one after another. Each round is a few saves of one path by
different writer slots (a slot is one rank of the job on one simulated node: a process, replaced
by a fresh one, with the same rank, after a save that ends its process), in one of three shapes:

- together: every save of the round is in flight at one moment (the writers meet inside
  torch.save, after the hook's start and before the file's first byte): an overlap by
  construction, not by timing luck;
- staggered: the first save is large and the others start a random moment after it started:
  overlapping or not, the writers' true intervals say which;
- sequential: each save starts a drawn gap after the previous one ended, from 0 to the window
  (and now and then beyond it, where nothing may be reported).

A save may end its process right after it returns (normal exit, os._exit, SIGTERM's default
action, SIGKILL) or be SIGKILLed by the harness while it writes (a large save). Such a save is
made either by the rank's process itself (then replaced by a fresh one: a second torch import)
or, on a node-local path, by a child forked from it for the save, as multiprocessing's fork
start method does (cheap; a forked child has no job scope of its own, so never on shared
storage). A path is
node-local (one node's writers only) or on storage marked shared (any node's writers); a round
now and then writes a path an earlier round wrote, so rounds interact as the truth says.

What the schedule says is intent; the writers' logged intervals are what is judged.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

TOGETHER, STAGGERED, SEQUENTIAL = "together", "staggered", "sequential"
SHAPES = (TOGETHER, STAGGERED, SEQUENTIAL)
# How a writer's process leaves after its save: it stays for later saves, or exits normally
# (atexit runs), through os._exit (multiprocessing's children), by SIGTERM's default action or
# by SIGKILL right after the save; KILLED: SIGKILLed by the harness while it writes.
STAY, EXIT, OS_EXIT, SIGTERM, SIGKILL, KILLED = (
    "stay", "exit", "os_exit", "sigterm", "sigkill", "killed")
EXITS = (EXIT, OS_EXIT, SIGTERM, SIGKILL)
# Floats per save: 4 KiB, 4 MiB, and 64 MiB for a save that is killed while it writes (long
# enough, even on a quiet machine, that the kill lands inside it).
SMALL, MEDIUM, LARGE = 1024, 1024 * 1024, 16 * 1024 * 1024


@dataclass(frozen=True)
class Profile:
    """The shape of a simulated job and of its schedules."""

    nodes: tuple[str, ...] = ("node-a", "node-b")
    local_world: int = 2            # ranks per node
    rounds: int = 12
    window: float = 2.0             # the agents' collision window and job scope's window
    p_shared: float = 0.5           # a round writes shared storage (else a node-local path)
    p_reuse: float = 0.25           # a round writes a path an earlier round wrote
    p_exit: float = 0.3             # a save ends its process (one of EXITS)
    p_killed: float = 0.15          # a round has a save SIGKILLed while it writes
    p_beyond: float = 0.15          # a sequential gap beyond the window (nothing to report)
    max_writers: int = 3
    p_fork: float = 0.5             # a save that ends its process is made by a forked child

    @property
    def slots(self) -> list[tuple[str, int]]:
        return [(node, local) for node in self.nodes for local in range(self.local_world)]

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.local_world

    def rank(self, slot: tuple[str, int]) -> int:
        return self.nodes.index(slot[0]) * self.local_world + slot[1]


@dataclass(frozen=True)
class Save:
    """One planned save: by which slot, how large, how its process leaves, and (sequential)
    the gap after the previous save of the round ended, or (staggered) the delay after the
    first save started."""

    slot: tuple[str, int]
    numel: int = SMALL
    exit: str = STAY
    delay: float = 0.0
    fork: bool = False              # made by a child forked from the slot's process


@dataclass(frozen=True)
class Round:
    shape: str
    path: str                       # relative: "<node>/<name>" node-local, "shared/<name>"
    saves: tuple[Save, ...]

    @property
    def shared(self) -> bool:
        return self.path.startswith("shared/")


@dataclass(frozen=True)
class Schedule:
    seed: int
    profile: Profile
    rounds: tuple[Round, ...] = field(default_factory=tuple)


def make_schedule(seed: int, profile: Profile = Profile()) -> Schedule:
    rng = random.Random(seed)
    rounds: list[Round] = []
    paths: list[str] = []
    for n in range(profile.rounds):
        shape = rng.choice(SHAPES)
        shared = len(profile.nodes) > 1 and rng.random() < profile.p_shared
        if shared:
            pool = profile.slots
        else:
            node = rng.choice(profile.nodes)
            pool = [s for s in profile.slots if s[0] == node]
        count = rng.randint(2, max(2, min(profile.max_writers, len(pool))))
        slots = rng.sample(pool, count)
        if shared and len({s[0] for s in slots}) == 1 and len(profile.nodes) > 1:
            # A shared round is about several nodes: swap one writer for another node's.
            other = [s for s in profile.slots if s[0] != slots[0][0]]
            slots[-1] = rng.choice(other)
        prefix = "shared/" if shared else f"{slots[0][0]}/"
        earlier = [p for p in paths if p.startswith(prefix)]
        if earlier and rng.random() < profile.p_reuse:
            path = rng.choice(earlier)
        else:
            path = f"{prefix}r{n:02d}.pt"
            paths.append(path)
        killed = rng.random() < profile.p_killed
        victim = rng.randrange(count) if killed else None
        saves = []
        for i, slot in enumerate(slots):
            if i == victim:
                exit_, numel = KILLED, LARGE
            else:
                exit_ = rng.choice(EXITS) if rng.random() < profile.p_exit else STAY
                numel = MEDIUM if rng.random() < 0.2 else SMALL
            delay = 0.0
            if shape == STAGGERED and i == 0 and exit_ != KILLED:
                numel = MEDIUM * 8          # 32 MiB: the others start while it writes
            elif shape == STAGGERED and i > 0:
                delay = rng.uniform(0.0, 0.15)
            elif shape == SEQUENTIAL and i > 0:
                beyond = rng.random() < profile.p_beyond
                delay = (rng.uniform(profile.window + 0.3, profile.window + 0.8) if beyond
                         else rng.uniform(0.0, profile.window))
            fork = exit_ != STAY and not shared and rng.random() < profile.p_fork
            saves.append(Save(slot, numel, exit_, round(delay, 3), fork))
        rounds.append(Round(shape, path, tuple(saves)))
    return Schedule(seed, profile, tuple(rounds))
