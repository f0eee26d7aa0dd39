"""A 20-line controller: two workers split a batch, compute, and all-reduce (run: python examples/controller_quickstart.py)."""

import torch
import torch.distributed as dist

from tandem.controller import ResourcePool, Worker, create_worker_group, register
from tandem.protocol import Batch


class SquareWorker(Worker):
    @register(dispatch="DP_COMPUTE")  # each rank gets one slice of the batch; outputs are concatenated
    def square(self, batch: Batch) -> Batch:
        return batch.assign(tensors={"y": batch["x"] ** 2})

    @register(dispatch="ONE_TO_ALL")  # every rank gets the same arguments; the result is a list
    def total(self, batch: Batch) -> float:
        self.init_process_group()  # gloo on CPU, NCCL on GPU
        local = batch["y"][self.rank :: self.world_size].sum()
        dist.all_reduce(local)
        return float(local)


if __name__ == "__main__":
    backend = "ray" if __import__("sys").argv[1:] == ["ray"] else "local"
    with create_worker_group(SquareWorker, ResourcePool((2,)), backend) as workers:
        batch = workers.square(Batch({"x": torch.arange(5.0).unsqueeze(-1)}))  # 5 rows: padded to 6, unpadded
        print("squares:", batch["y"].flatten().tolist())
        print("all-reduced total on each rank:", workers.total(batch))
