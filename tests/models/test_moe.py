"""Mixture-of-experts blocks: HF's grouped experts against a per-token loop, routing replay,
the load-balancing loss and routing metrics through the training engine."""

import pytest
import torch
from transformers.models.qwen2_moe.modeling_qwen2_moe import load_balancing_loss_func

from tandem.engine import EngineConfig, TorchTrainEngine
from tandem.models import TinyModelConfig, build_tiny_model
from tandem.models.moe import RouterTap, moe_routers, replayed_weights
from tandem.protocol import Batch

FAMILIES = ["qwen2_moe", "qwen3_moe"]


def tiny(family: str, seed: int = 0):
    return build_tiny_model(TinyModelConfig(family=family, seed=seed), 103, 0, 1, 2)


def per_token_experts(experts, hidden, chosen, weights):
    """Reference: each token through each of its chosen experts, one at a time."""
    rows = []
    for token in range(hidden.shape[0]):
        total = torch.zeros_like(hidden[token])
        for slot in range(chosen.shape[1]):
            expert = int(chosen[token, slot])
            gate, up = (experts.gate_up_proj[expert] @ hidden[token]).chunk(2)
            total = total + weights[token, slot] * (experts.down_proj[expert] @ (experts.act_fn(gate) * up))
        rows.append(total)
    return torch.stack(rows)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_grouped_experts_equal_a_per_token_loop(family):
    block = tiny(family).model.layers[0].mlp
    hidden = torch.randn(37, 128, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    _, weights, chosen = block.gate(hidden)
    grouped = block.experts(hidden, chosen, weights)
    reference = per_token_experts(block.experts, hidden, chosen, weights)
    torch.testing.assert_close(grouped, reference, atol=1e-6, rtol=1e-5)
    probe = torch.randn_like(grouped)
    inputs = [hidden, block.experts.gate_up_proj, block.gate.weight]
    wanted = torch.autograd.grad((reference * probe).sum(), inputs, retain_graph=True)
    got = torch.autograd.grad((grouped * probe).sum(), inputs)
    for a, b in zip(got, wanted, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_replaying_the_live_choice_changes_no_bit(family):
    model = tiny(family)
    tap = RouterTap(model)
    ids = torch.randint(3, 103, (3, 11))
    live = model(ids).logits
    with tap.replaying(tap.recorded()):
        assert torch.equal(model(ids).logits, live)


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_runs_the_recorded_experts_with_live_renormalised_weights(family):
    """Replayed experts, weights = softmax(live logits) at them (renormalised when the family
    does), equal to a per-token loop over the recorded experts; the router keeps a gradient."""
    model = tiny(family)
    router = moe_routers(model)[0]
    hidden = torch.randn(9, 128, generator=torch.Generator().manual_seed(1))
    recorded = torch.stack([torch.randperm(4)[:2] for _ in range(9)])  # [N, k], mostly not the live choice
    recorded[0] = -1  # not routed by the rollout: live
    tap = RouterTap(model)
    with tap.replaying(recorded[:, None].expand(9, 2, 2).to(torch.int16)):
        logits, weights, used = router(hidden)
    live = torch.topk(torch.softmax(logits, -1), 2).indices
    assert torch.equal(used[0], live[0]) and torch.equal(used[1:], recorded[1:])
    probs = torch.softmax(logits.float(), -1).gather(-1, used)
    expected = probs / probs.sum(-1, keepdim=True) if router.norm_topk_prob else probs
    torch.testing.assert_close(weights, expected)
    torch.testing.assert_close(weights, replayed_weights(logits, used, router.norm_topk_prob))
    (grad,) = torch.autograd.grad((weights * torch.arange(1.0, 3.0)).sum(), router.weight)
    assert grad.abs().sum() > 0


def engine(model, **config):
    trainer = TorchTrainEngine(EngineConfig(lr=1e-3, pad_tokens_to_multiple=16, **config), model=model)
    trainer.initialize()
    return trainer


def padded_batch(seed: int = 0, layers: int = 2, rows: int = 4):
    """Right-padded rows with a random recorded routing (-1 on padding and each row's last token)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [13, 7, 10, 4][:rows]
    ids = torch.randint(3, 103, (rows, 13), generator=gen)
    mask = (torch.arange(13)[None] < torch.tensor(lengths)[:, None]).long()
    routed = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(rows * 13 * layers)])
    routed = routed.view(rows, 13, layers, 2).to(torch.int16)
    routed[~mask.bool()] = -1
    for row, length in enumerate(lengths):
        routed[row, length - 1] = -1
    return Batch({"input_ids": ids * mask, "attention_mask": mask, "routed_experts": routed})


def summed_log_probs(micro, outputs):
    return outputs.log_probs.sum(), {}


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_replay_equals_padded_replay_and_differs_from_live(family):
    batch = padded_batch()
    packed = engine(tiny(family), router_replay="rollout")
    padded = engine(tiny(family), router_replay="rollout", use_packing=False)
    live = engine(tiny(family))
    replayed = packed.forward_backward(batch, None, forward_only=True).outputs.log_probs
    reference = padded.forward_backward(batch, None, forward_only=True).outputs.log_probs
    torch.testing.assert_close(replayed, reference, atol=1e-5, rtol=0)
    unreplayed = live.forward_backward(batch, None, forward_only=True).outputs.log_probs
    assert (unreplayed - replayed).abs().max() > 1e-3
    result = live.forward_backward(batch, summed_log_probs)
    assert result.metrics["moe/routing_disagreement"][0] > 0.5  # random routing: most tokens differ
    routers = [name for name, p in packed.causal_lm.named_parameters() if name.endswith("gate.weight")]
    packed.forward_backward(batch, summed_log_probs)
    grads = dict(packed.causal_lm.named_parameters())
    assert all(grads[name].grad.abs().sum() > 0 for name in routers)


@pytest.mark.parametrize("family", FAMILIES)
def test_aux_loss_equals_hf_and_moves_the_router_gradient(family):
    batch = padded_batch()
    del batch.tensors["routed_experts"]
    model = tiny(family)
    with torch.no_grad():
        hf = model(batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True)
        expected = load_balancing_loss_func(hf.router_logits, 4, 2, batch["attention_mask"])
    without = engine(tiny(family))
    with_aux = engine(tiny(family), moe_aux_loss_coef=0.5)
    for config in ({}, {"use_packing": False}):
        trainer = engine(tiny(family), moe_aux_loss_coef=0.5, **config)
        result = trainer.forward_backward(batch, summed_log_probs)
        assert result.metrics["moe/aux_loss"][0] == pytest.approx(float(expected), abs=1e-6)
    without.forward_backward(batch, summed_log_probs)
    with_aux.forward_backward(batch, summed_log_probs)
    router = "model.layers.0.mlp.gate.weight"
    base = dict(without.causal_lm.named_parameters())[router].grad
    aux = dict(with_aux.causal_lm.named_parameters())[router].grad
    assert (aux - base).abs().max() > 1e-6
    trainer = engine(tiny(family))
    metrics = trainer.forward_backward(batch, summed_log_probs).metrics
    assert 0.25 <= metrics["moe/load_max_share"][0] <= 0.5  # 1/E balanced .. 1/k in every top-k
    assert "moe/aux_loss" not in metrics


def test_moe_settings_name_the_field():
    with pytest.raises(ValueError, match="engine.moe_aux_loss_coef=-0.1 is outside"):
        EngineConfig(moe_aux_loss_coef=-0.1)
    with pytest.raises(ValueError, match="engine.router_replay='always'"):
        EngineConfig(router_replay="always")
    with pytest.raises(ValueError, match="engine.ep_size=0 is outside"):
        EngineConfig(ep_size=0)
    dense = build_tiny_model(TinyModelConfig(family="qwen2"), 103, 0, 1, 2)
    with pytest.raises(ValueError, match="engine.moe_aux_loss_coef=0.01: Qwen2ForCausalLM has no mixture"):
        engine(dense, moe_aux_loss_coef=0.01)
    with pytest.raises(ValueError, match="engine.router_replay='rollout': Qwen2ForCausalLM"):
        engine(dense, router_replay="rollout")
    trainer = engine(tiny("qwen3_moe"), router_replay="rollout")
    batch = padded_batch()
    del batch.tensors["routed_experts"]
    with pytest.raises(ValueError, match="needs the batch's 'routed_experts'"):
        trainer.forward_backward(batch, None, forward_only=True)
