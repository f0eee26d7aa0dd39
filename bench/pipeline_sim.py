"""A small discrete-event model of the three RL pipelines, to project measured phase times to many GPUs.

The model:

* **Rollout.** Every rollout GPU is a continuous-batching server holding at most ``capacity``
  sequences. One decode step advances every active sequence by ``unit`` tokens and takes
  ``decode_s`` seconds, whatever the occupancy: GPU decoding is memory-bound, so a step costs
  about the same for one sequence as for a full batch. A sequence's length is drawn from a
  long-tail distribution. A prompt group is finished when all of its ``n`` responses are.
* **Training.** It costs ``train_token_s`` per trained token, divided over the training GPUs.
* **Weight sync.** It pauses the rollout for ``sync_s``.

The pipelines:

* ``sync``: all GPUs generate the step's groups, then all of them train.
* ``one_step_off``: ``rollout_share`` of the GPUs generate batch k+1 while the rest train batch k.
* ``fully_async``: the rollout GPUs generate continuously. They may run
  ``staleness + 1`` batches ahead of the trainer, and a weight sync lets requests in flight
  continue (partial rollout).

The response lengths stand in for a long-tail math-reasoning run like verl's fully-async one
(Qwen2.5-7B, DAPO, responses up to 28k tokens). verl does not publish the distribution, so
this model assumes a log-normal with median ``max_len / 8`` and sigma 1.0, capped at
``max_len``: about 2% of the responses hit the cap.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Workload:
    """One RL step's work and the unit costs (see the module docstring)."""

    groups: int = 512  # prompts per step
    n: int = 16  # responses per prompt
    max_len: int = 28_672  # tokens
    unit: int = 256  # tokens per simulated decode step (coarser is faster, same shape)
    capacity: int = 256  # sequences per rollout GPU
    decode_s: float = 1.0  # seconds per decode step of ``unit`` tokens on one rollout GPU
    train_token_s: float = 1e-4  # seconds per trained token on one GPU
    sync_s: float = 5.0

    @classmethod
    def from_measured(cls, generate_s: float, train_s: float, sync_s: float, gpus: int = 8) -> Workload:
        """Unit costs under which a ``gpus``-GPU sync step splits into the measured shares of
        generation, training and weight sync (the shares, not the absolute seconds, carry over)."""
        probe = cls(decode_s=1.0, train_token_s=1.0, sync_s=0.0)
        lengths = probe.sample_lengths(np.random.default_rng(0), probe.groups * probe.n)
        gen_1 = _generate_once(probe, lengths, gpus)  # seconds of generation at decode_s = 1
        tokens = float(lengths.sum()) * probe.unit
        step = 100.0  # any scale: only the shares matter
        total = generate_s + train_s + sync_s
        return cls(
            decode_s=step * generate_s / total / gen_1,
            train_token_s=step * train_s / total / (tokens / gpus),
            sync_s=step * sync_s / total,
        )

    def sample_lengths(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """Response lengths in decode steps (``unit`` tokens each)."""
        tokens = rng.lognormal(math.log(self.max_len / 8), 1.0, count).clip(1, self.max_len)
        return np.ceil(tokens / self.unit).astype(np.int64)


def _generate_once(work: Workload, lengths: np.ndarray, gpus: int) -> float:
    """Seconds for ``gpus`` servers to generate ``lengths`` (split evenly), waiting for the longest."""
    longest = 0.0
    for share in np.array_split(lengths, gpus):
        longest = max(longest, _server_time(share, work.capacity) * work.decode_s)
    return longest


def _server_time(lengths: np.ndarray, capacity: int) -> int:
    """Decode steps for one server to finish ``lengths`` in order, ``capacity`` at a time."""
    if len(lengths) <= capacity:
        return int(lengths.max(initial=0))
    # A slot frees when its sequence ends; the next one in line takes it.
    slots = np.zeros(capacity, dtype=np.int64)
    for length in lengths:
        i = int(slots.argmin())
        slots[i] += length
    return int(slots.max())


def step_time_sync(work: Workload, gpus: int, rng: np.random.Generator) -> float:
    lengths = work.sample_lengths(rng, work.groups * work.n)
    return (
        _generate_once(work, lengths, gpus)
        + lengths.sum() * work.unit * work.train_token_s / gpus
        + work.sync_s
    )


def step_time_one_step_off(work: Workload, gpus: int, rollout_gpus: int, rng: np.random.Generator) -> float:
    lengths = work.sample_lengths(rng, work.groups * work.n)
    generate = _generate_once(work, lengths, rollout_gpus)
    train = lengths.sum() * work.unit * work.train_token_s / (gpus - rollout_gpus)
    return max(generate, train) + work.sync_s


def run_fully_async(work: Workload, gpus: int, rollout_gpus: int, steps: int, staleness: int, rng) -> float:
    """Mean seconds per step of the streaming pipeline after its first step (an event loop at
    decode-step resolution; the rollout GPUs' slots are pooled)."""
    trainer_gpus, slots = gpus - rollout_gpus, rollout_gpus * work.capacity
    remaining = np.zeros(0, dtype=np.int64)  # decode steps left, per active sequence
    owner = np.zeros(0, dtype=np.int64)  # its group
    backlog: list[tuple[int, int]] = []  # (group, length) handed out, not yet admitted
    left: dict[int, int] = {}  # responses still generating, per group
    tokens: dict[int, int] = {}  # decode steps, per group
    finished: list[int] = []
    clock, paused_until, busy_until = 0.0, 0.0, None
    started = version = 0
    ends: list[float] = []
    while len(ends) < steps:
        while started < (version + staleness + 1) * work.groups:  # what the staleness bound allows
            left[started] = work.n
            for length in work.sample_lengths(rng, work.n):
                backlog.append((started, int(length)))
                tokens[started] = tokens.get(started, 0) + int(length)
            started += 1
        if busy_until is not None and clock >= busy_until:  # training ended: sync, then the next step
            paused_until = clock + work.sync_s
            version, busy_until = version + 1, None
            ends.append(paused_until)
            clock = paused_until
            continue
        if busy_until is None and len(finished) >= work.groups:
            batch, finished = finished[: work.groups], finished[work.groups :]
            trained = sum(tokens.pop(g) for g in batch) * work.unit
            busy_until = clock + trained * work.train_token_s / trainer_gpus
        if clock < paused_until:
            clock = paused_until
            continue
        free = slots - len(remaining)
        if free > 0 and backlog:
            admitted, backlog = backlog[:free], backlog[free:]
            remaining = np.concatenate([remaining, np.array([n for _, n in admitted], dtype=np.int64)])
            owner = np.concatenate([owner, np.array([g for g, _ in admitted], dtype=np.int64)])
        clock += work.decode_s
        if len(remaining):
            remaining = remaining - 1
            done = remaining <= 0
            for group in owner[done].tolist():
                left[group] -= 1
                if left[group] == 0:
                    finished.append(group)
            remaining, owner = remaining[~done], owner[~done]
    return (ends[-1] - ends[0]) / (steps - 1)


def project(work: Workload, gpu_counts=(8, 16, 32, 64, 128), steps: int = 6, staleness: int = 1) -> str:
    """A table: seconds per step of each pipeline and the speed-ups over sync, per GPU count
    (the rollout share of the asynchronous pipelines is the best of 1/4, 1/2 and 3/4)."""
    rows = [
        f"{'GPUs':>5}{'sync s':>9}{'1-off s':>9}{'async s':>9}{'1-off x':>9}{'async x':>9}  rollout GPUs (1-off/async)"
    ]
    for gpus in gpu_counts:
        rng = np.random.default_rng(gpus)
        sync = np.mean([step_time_sync(work, gpus, rng) for _ in range(steps)])
        shares = sorted({max(1, min(gpus - 1, round(gpus * f))) for f in (0.25, 0.5, 0.75)})
        one_off = {
            r: np.mean([step_time_one_step_off(work, gpus, r, rng) for _ in range(steps)]) for r in shares
        }
        fully = {
            r: run_fully_async(work, gpus, r, steps + 1, staleness, np.random.default_rng(gpus + r))
            for r in shares
        }
        best_off, best_async = min(one_off, key=one_off.get), min(fully, key=fully.get)
        rows.append(
            f"{gpus:>5}{sync:>9.1f}{one_off[best_off]:>9.1f}{fully[best_async]:>9.1f}"
            f"{sync / one_off[best_off]:>8.2f}x{sync / fully[best_async]:>8.2f}x  {best_off}/{best_async}"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    print(project(dataclasses.replace(Workload())))
