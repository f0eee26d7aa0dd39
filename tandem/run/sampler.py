"""A shuffling sampler whose position can be saved and restored exactly."""

from __future__ import annotations

import torch


class EpochSampler:
    """Indices ``0..n-1`` in a fresh seeded permutation each epoch; ``state()``/``load_state()`` resume exactly."""

    def __init__(self, size: int, seed: int, shuffle: bool = True) -> None:
        if size < 1:
            raise ValueError(f"cannot sample from an empty dataset (size {size})")
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch, self.cursor = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.size))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.size, generator=generator).tolist()

    def take(self, count: int) -> list[int]:
        """The next ``count`` indices, continuing into the next epoch when this one runs out."""
        out = []
        while len(out) < count:
            if self.cursor == self.size:
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(count - len(out), self.size - self.cursor)
            out.extend(self._order[self.cursor : self.cursor + take])
            self.cursor += take
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "size": self.size}

    def load_state(self, state: dict[str, int]) -> None:
        if state["size"] != self.size or state["seed"] != self.seed:
            raise ValueError(
                f"sampler state is for size {state['size']}/seed {state['seed']}, not {self.size}/{self.seed}"
            )
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._order = self._permutation(self.epoch)
