"""Megatron-LM's loss, norm and learning-rate flags on two ranks.

--cross-entropy-loss-fusion: the trainer's model computes megatron-core's fused
vocab-parallel cross entropy (its native implementation runs on CPU), on two tensor-parallel
ranks: the loss is the unfused one's, and the gradient the unfused one's up to the bf16
rounding that the fused backward applies to the logits' gradient (as on a GPU).

--calculate-per-token-loss: the loss function hands megatron-core's schedule the token sum and
count, and the logged loss is all ranks' summed token losses over their summed token counts
(not the mean of per-micro-batch means), on two data-parallel ranks with unequal masks.

--apply-layernorm-1p and --decoupled-lr reach the model and the optimizer megatron-core
builds (tests/unit/training/cli/test_recipe_flags.py checks the flags themselves).

Micro-batches (--rampup-batch-size changes their number from one iteration to the next):
megatron-core's schedule, running the trainer's forward step, runs the number of micro-batches
it is told and divides each one's loss by that same number: one call's gradient is the mean
over its micro-batches, whatever their number; with --calculate-per-token-loss it is their
token sum (finalize_model_grads divides by the tokens)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.spawn import spawn

FLAGS = ("--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--micro-batch-size 2 --train-iters 1 --lr 1e-3 --mock-data --hidden-dropout 0 "
         "--attention-dropout 0 --tensor-model-parallel-size 2").split()


def _check(rank: int, world: int) -> None:
    from megatron.core import tensor_parallel

    from megatron.sdp4bit.training.cli.arguments import parse_args
    from megatron.sdp4bit.training.model import build_model, transformer_config_from_args
    from tests.helpers.tiny_gpt import init_parallel

    init_parallel(tp=2)
    out = []
    for extra in ([], ["--cross-entropy-loss-fusion"]):
        tensor_parallel.model_parallel_cuda_manual_seed(1)
        torch.manual_seed(1)
        args = parse_args(FLAGS + extra, world_size=world)
        config = transformer_config_from_args(args)
        assert config.cross_entropy_loss_fusion == bool(extra)
        model = build_model(args, config, 128)
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 128, (2, 16), generator=gen)
        labels = torch.randint(0, 128, (2, 16), generator=gen)
        loss = model(tokens, torch.arange(16).expand(2, -1), None, labels=labels)
        loss.sum().backward()
        grad = model.shared_embedding_or_output_weight().grad  # this rank's vocabulary shard
        out.append((loss.detach(), grad.clone()))
    (plain, plain_grad), (fused, fused_grad) = out
    # the same fp32 operations up to their order: a few ulps of ln(128) ~ 4.9
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-5)
    # the logits' gradient rounded to bf16 (relative 2**-8 each), summed over 32 tokens
    bound = 2 ** -8 * plain_grad.abs().max().item() * 4
    assert (fused_grad - plain_grad).abs().max().item() <= bound
    assert not torch.equal(fused_grad, plain_grad)  # the fused kernel did run
    _check_micro_batch_count(model, gen)
    _check_recipe_flags(world)


def _check_recipe_flags(world: int) -> None:
    """--apply-layernorm-1p: a model whose norms are zero-centred computes, at its start,
    the plain one's loss bit for bit (scale 1 + 0). --decoupled-lr / --decoupled-min-lr: the
    optimizer megatron-core builds gives the (tied) embedding a parameter group of its own,
    which the trainer's scheduler takes from 5e-3 to 1e-4 while the rest goes from 1e-3 to 0."""
    from megatron.core import tensor_parallel

    from megatron.sdp4bit.training import build
    from megatron.sdp4bit.training.cli.arguments import parse_args
    from megatron.sdp4bit.training.model import (build_model, build_optimizer,
                                                 transformer_config_from_args, wrap_ddp)

    losses, models = [], []
    for extra in ([], ["--apply-layernorm-1p"]):
        tensor_parallel.model_parallel_cuda_manual_seed(1)
        torch.manual_seed(1)
        args = parse_args(FLAGS + extra, world_size=world)
        config = transformer_config_from_args(args)
        model = build_model(args, config, 128)
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 128, (2, 16), generator=gen)
        labels = torch.randint(0, 128, (2, 16), generator=gen)
        losses.append(model(tokens, torch.arange(16).expand(2, -1), None,
                            labels=labels).detach())
        models.append((args, config, model))
    assert torch.equal(losses[0], losses[1])
    args, config, model = models[1]
    norms = [p for name, p in model.named_parameters() if "layernorm.weight" in name]
    assert len(norms) == 3 and not any(p.any() for p in norms)  # 2 layers' and the final

    args = parse_args(FLAGS + ["--decoupled-lr", "5e-3", "--decoupled-min-lr", "1e-4",
                               "--use-distributed-optimizer"], world_size=world)
    ddp = wrap_ddp(args, config, model)
    optimizer = build_optimizer(args, [ddp])
    scheduler = build._scheduler(args, optimizer)
    embedding = model.shared_embedding_or_output_weight()
    inner, = optimizer.chained_optimizers  # megatron-core's chain of one

    def groups():  # (the embedding's, the others), as the optimizer holds them now
        index, _ = inner.model_param_group_index_map[embedding]  # its main shard's group
        mine = inner.param_groups[index]
        assert len(mine["params"]) == 1  # the embedding's main shard alone
        return mine, [g for g in inner.param_groups if g["params"] and g is not mine]

    mine, others = groups()
    assert others and all(g["max_lr"] == 1e-3 and g["lr"] == 1e-3 for g in others)
    assert (mine["max_lr"], mine["min_lr"], mine["lr"]) == (5e-3, 1e-4, 5e-3)
    # A resume's load must give each group its own rates back (megatron-core 0.16.1 matches
    # the saved groups by wd_mult, lr_mult, expert and is_decoupled_lr: training/model.py).
    ddp(tokens, torch.arange(16).expand(2, -1), None, labels=labels).mean().backward()
    ddp.finish_grad_sync()
    assert optimizer.step()[0]  # the state a checkpoint holds exists after a step
    optimizer.load_state_dict(optimizer.state_dict())
    mine, others = groups()
    assert (mine["max_lr"], mine["min_lr"]) == (5e-3, 1e-4)
    assert all((g["max_lr"], g["min_lr"]) == (1e-3, 0.0) for g in others)
    scheduler.step(increment=args.global_batch_size // 2)  # half the linear decay
    assert mine["lr"] == pytest.approx(1e-4 + (5e-3 - 1e-4) / 2, rel=1e-12)
    assert all(g["lr"] == pytest.approx(1e-3 / 2, rel=1e-12) for g in others)


def _check_micro_batch_count(model, gen: torch.Generator) -> None:
    """Gradients of one schedule call over micro-batches b1, b2 against the calls over b1
    and over b2 alone: their mean with the count 2 (the sum's halves are the same fp32
    numbers, up to the order of the sums), their sum with --calculate-per-token-loss."""
    from functools import partial

    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron.sdp4bit.training import step

    def micro_batch() -> dict[str, torch.Tensor]:
        return {"tokens": torch.randint(0, 128, (2, 16), generator=gen),
                "labels": torch.randint(0, 128, (2, 16), generator=gen),
                "loss_mask": torch.ones(2, 16), "position_ids": torch.arange(16).expand(2, -1)}

    batches = [micro_batch(), micro_batch()]
    params = [p for p in model.parameters() if p.requires_grad]

    def grads(data: list[dict], count: int, per_token: bool) -> list[torch.Tensor]:
        model.config.calculate_per_token_loss = per_token
        for p in params:
            p.grad = None
        get_forward_backward_func()(
            forward_step_func=partial(step._forward_step, per_token=per_token),
            data_iterator=iter(data), model=[model], num_microbatches=count, seq_length=16,
            micro_batch_size=2, forward_only=False)
        return [p.grad.clone() for p in params]

    for per_token in (False, True):
        both = grads(batches, 2, per_token)
        one, two = grads(batches[:1], 1, per_token), grads(batches[1:], 1, per_token)
        for b, x, y in zip(both, one, two):
            want = x + y if per_token else (x + y) / 2
            torch.testing.assert_close(b, want, rtol=1e-5, atol=1e-7)
    model.config.calculate_per_token_loss = False


def test_fused_cross_entropy_matches_the_unfused_one():
    spawn(_check, 2)


def _check_per_token(rank: int, world: int) -> None:
    import torch.distributed as dist

    from megatron.sdp4bit.training.cli.arguments import parse_args
    from megatron.sdp4bit.training.model import transformer_config_from_args
    from megatron.sdp4bit.training.step import _loss_func, mean_loss, per_token_loss

    args = parse_args(FLAGS[:-2] + ["--calculate-per-token-loss"], world_size=world)
    assert transformer_config_from_args(args).calculate_per_token_loss
    gen = torch.Generator().manual_seed(5)
    token_losses = [torch.rand(2, 16, generator=gen) * 5 for _ in range(4)]  # 2 ranks x 2
    masks = [(torch.rand(2, 16, generator=gen) < p).float() for p in (0.9, 0.2, 0.5, 0.7)]
    mine = range(2 * rank, 2 * rank + 2)
    per_token, averaged = [], []
    for i in mine:
        total, count, report = _loss_func(masks[i], False, token_losses[i], per_token=True)
        assert total.item() == pytest.approx(float((token_losses[i] * masks[i]).sum()), rel=1e-6)
        assert count.dtype == torch.int and count.item() == int(masks[i].sum())
        per_token.append(report)
        averaged.append(_loss_func(masks[i], False, token_losses[i])[1])
    group = dist.group.WORLD
    want = float(sum((l * m).sum() for l, m in zip(token_losses, masks)) /
                 sum(m.sum() for m in masks))
    assert per_token_loss(per_token, group) == pytest.approx(want, rel=1e-6)
    # the unequal masks make the default mean of means another number
    assert abs(mean_loss(averaged, group) - want) > 1e-3


def test_per_token_loss_is_the_token_weighted_mean_over_ranks():
    spawn(_check_per_token, 2)
