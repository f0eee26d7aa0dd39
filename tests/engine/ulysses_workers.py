"""A worker holding a training engine on a ``(dp, sp)`` mesh (the Ulysses tests' processes)."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from tandem.algos.aggregation import LossNormalizer, aggregate_loss
from tandem.controller import Worker, mesh_dispatch, register
from tandem.device import bind_device
from tandem.engine import EngineConfig, TokenOutputs, TorchTrainEngine
from tandem.engine.ulysses import SequenceParallel, all_to_all, sum_disjoint
from tandem.engine.ulysses_attention import ulysses_attention
from tandem.engine.varlen_attention import contiguous_plan
from tandem.protocol import Batch

MESH = "engine"


def every_output_loss(
    micro: Batch, outputs: TokenOutputs, normalizer: LossNormalizer
) -> tuple[torch.Tensor, dict]:
    """A loss that reads every output a head makes (log-probs and entropy, values, scores), so
    the gradient flows through each of them: the token mean of their weighted sum."""
    weights = {"log_probs": -1.0, "entropy": 0.1, "values": 0.5, "scores": 0.5}
    per_token = sum(weight * getattr(outputs, name) ** (2 if name == "values" else 1)
                    for name, weight in weights.items() if getattr(outputs, name) is not None)  # fmt: skip
    return aggregate_loss(per_token, micro["loss_mask"], "token-mean", normalizer), {}


class UlyssesWorker(Worker):
    """Joins the group's gloo process group once; each :meth:`build` makes a fresh engine in it
    (one group of processes serves every configuration a test module tries)."""

    def __init__(self, device: str = "cpu") -> None:
        """``device``: ``cpu`` (gloo) or ``cuda`` (NCCL, one GPU per rank)."""
        self.device = bind_device(device)
        if self.world_size > 1:
            self.init_process_group(device=self.device)

    @register(dispatch="ONE_TO_ALL")
    def build(self, config: EngineConfig) -> None:
        self.engine = TorchTrainEngine(config)
        self.engine.initialize()
        mesh = self.engine.mesh
        self.set_mesh_rank(MESH, mesh.dp_rank, mesh.dp_size, is_collect=mesh.collects)

    def _outputs_and_loss(self, batch: Batch) -> tuple[dict[str, torch.Tensor], float]:
        """The forward-only outputs ``[B, S]`` of ``batch`` (a policy's ``sum_pi_squared`` too), then
        one forward/backward of :func:`every_output_loss` (its gradients left on the parameters);
        and the loss."""
        policy = self.engine.config.head == "lm"
        outputs = self.engine.forward_backward(
            batch, None, forward_only=True, with_sum_pi_squared=policy
        ).outputs.fields()
        normalizer = self.engine.global_normalizer(batch["loss_mask"])
        loss_fn = functools.partial(every_output_loss, normalizer=normalizer)
        result = self.engine.forward_backward(batch, loss_fn)
        return {name: values for name, values in outputs.items() if values is not None}, result.loss

    @register(dispatch="ONE_TO_ALL")
    def gradients(self, batch: Batch) -> dict:
        """Every rank's outputs, loss and the full gradient of each trainable parameter."""
        outputs, loss = self._outputs_and_loss(batch)
        grads = {}
        for name, param in self.engine.causal_lm.named_parameters():
            if param.requires_grad:
                grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
                grads[name] = grad.detach().cpu().clone()
        self.engine.zero_grad()
        return {"outputs": outputs, "loss": loss, "grads": grads}

    @register(dispatch="ONE_TO_ALL")
    def token_choices(self, batch: Batch, top_k: int) -> dict:
        """The forward-only ``top_k`` tokens and their log-probs, and the log-probs of the tokens the
        batch names (``gather_token_ids``); then the full gradient of a loss on the named ones."""
        outputs = self.engine.forward_backward(batch, None, forward_only=True, top_k=top_k).outputs

        def named_loss(micro: Batch, out: TokenOutputs) -> tuple[torch.Tensor, dict]:
            weights = micro["loss_mask"].to(torch.float32)[..., None]
            return -(out.gathered_log_probs * weights).sum() / 64.0, {}

        self.engine.forward_backward(batch, named_loss)
        grads = {}
        for name, param in self.engine.causal_lm.named_parameters():
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            grads[name] = grad.detach().cpu().clone()
        self.engine.zero_grad()
        chosen = ("top_ids", "top_log_probs", "gathered_log_probs")
        return {"outputs": {name: getattr(outputs, name) for name in chosen}, "grads": grads}

    @register(dispatch="ALL_TO_ALL")
    def log_probs_of(self, batch: Batch) -> torch.Tensor:
        """The log-probs of a batch of this rank's own (ranks may be handed different ones)."""
        return self.engine.forward_backward(batch, None, forward_only=True).outputs.log_probs

    @register(dispatch=mesh_dispatch(MESH))
    def train_step(self, batch: Batch) -> Batch:
        """One optimizer step on this data-parallel rank's rows; their pre-step outputs and the loss."""
        outputs, loss = self._outputs_and_loss(batch)
        grad_norm = self.engine.optimizer_step()
        rows = len(batch)
        extra = {"loss": torch.full((rows,), loss), "grad_norm": torch.full((rows,), grad_norm)}
        return Batch({**outputs, **extra})

    @register(dispatch="ONE_TO_ALL")  # under FSDP2 gathering full tensors is a collective
    def parameters(self) -> dict[str, torch.Tensor]:
        return {name: tensor.cpu().clone() for name, tensor in self.engine.iter_parameters()}

    @register(dispatch="ONE_TO_ALL")
    def collectives(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each Ulysses collective on this rank's part of whole tensors over the whole world, with
        the outputs, and the gradients a backward of ``sum(output * upstream)`` leaves on the input.

        ``inputs``: ``heads [1, H, T, D]`` and its upstream ``[1, H, T, D]``; ``tokens [1, T, D]``
        and its upstream; ``q [1, H, T, D]``, ``k, v [1, H_kv, T, D]``, ``cu_seqlens`` and the
        attention output's upstream ``[1, T, H, D]``.
        """
        inputs = {name: tensor.to(self.device) for name, tensor in inputs.items()}
        sp = SequenceParallel(dist.group.WORLD, self.world_size, self.rank)
        start, end = sp.bounds(inputs["tokens"].shape[1])
        results = {}

        def run(name: str, fn, local: list[torch.Tensor], upstream: torch.Tensor) -> None:
            leaves = [tensor.clone().requires_grad_() for tensor in local]
            output = fn(*leaves)
            (output * upstream).sum().backward()
            results[name] = output.detach().cpu()
            results.update({f"{name}/grad{i}": leaf.grad.cpu() for i, leaf in enumerate(leaves)})

        heads = inputs["heads"].shape[1] // sp.size
        mine = slice(self.rank * heads, (self.rank + 1) * heads)
        run(
            "all_to_all",
            lambda x: all_to_all(x, sp.group, scatter_dim=1, gather_dim=2),
            [inputs["heads"][:, :, start:end]],
            inputs["heads_upstream"][:, mine],
        )
        run("gather", sp.gather, [inputs["tokens"][:, start:end]], inputs["tokens_upstream"])
        disjoint = torch.zeros_like(inputs["tokens"])
        disjoint[:, start:end] = inputs["tokens"][:, start:end]
        run("sum_disjoint", lambda x: sum_disjoint(x, sp.group), [disjoint], inputs["tokens_upstream"])
        plan = contiguous_plan(inputs["cu_seqlens"].cpu()).to(self.device)
        run(
            "attention",
            lambda q, k, v: ulysses_attention(
                torch.nn.Module().eval(),
                q,
                k,
                v,
                None,
                tandem_sequence_parallel=sp,
                tandem_attention_plan=plan,
            )[0],
            [inputs[name][:, :, start:end] for name in ("q", "k", "v")],
            inputs["attention_upstream"][:, start:end],
        )
        return results
