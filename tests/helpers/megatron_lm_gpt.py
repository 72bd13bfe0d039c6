"""A GPT pretraining script in the shape Megatron-LM's trainer documents (megatron-core 0.19.2's
``megatron.training``): a model provider, a dataset provider and a forward step, handed to
``megatron.training.pretrain`` with the configuration container built from the parsed flags
(``--num-experts``: a mixture-of-experts GPT, as Megatron-LM's own script builds it).

It knows nothing of SDP4Bit: tests/e2e/test_megatron_lm_trainer.py runs it unchanged under
``python -m megatron.sdp4bit.megatron_lm``, as a Megatron-LM user runs their own
``pretrain_gpt.py``. Like that script it imports ``megatron.training`` at the top, so every
process that re-imports it (the ``spawn`` manager of a ``torch_dist`` save) needs Python
3.12's ``typing.override``: the test environment's interpreters get it at start-up
(integration/megatron_lm_bridges.py, [Note: the Python 3.12 bridge in every process]).
Mock data (``MockGPTDataset``: counting sequences, so the loss falls), the local layer spec
(no Transformer Engine).
"""

from __future__ import annotations

from functools import partial

import torch

from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.training import get_args, get_tokenizer, pretrain
from megatron.training.argument_utils import (
    core_transformer_config_from_args,
    pretrain_cfg_container_from_args,
)
from megatron.training.arguments import parse_and_validate_args


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None,
                   pg_collection=None) -> GPTModel:
    """The model of this pipeline stage, on the CPU, without DDP (the trainer wraps it)."""
    args = get_args()
    return GPTModel(
        config=core_transformer_config_from_args(args),
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=args.num_experts,
                                                         moe_grouped_gemm=args.moe_grouped_gemm),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        position_embedding_type=args.position_embedding_type,
        vp_stage=vp_stage,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """Mock GPT datasets of the sizes the trainer asks for."""
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        split=args.split,  # no blend: mock data
        tokenizer=get_tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    return BlendedMegatronDatasetBuilder(
        MockGPTDataset, train_val_test_num_samples,
        lambda: parallel_state.get_tensor_model_parallel_rank() == 0, config).build()


def _batch(data_iterator):
    """The next micro-batch on the current device (every rank reads its own: TP 1)."""
    sample = next(data_iterator)
    return {key: sample[key].cuda(non_blocking=True)
            for key in ("tokens", "labels", "loss_mask", "position_ids")}


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Summed loss over the unmasked tokens, their number, and what the log line shows."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum().to(torch.int)
    reporting = torch.cat([loss.clone().detach().view(1), tokens.view(1).float()])
    return loss, tokens, {"lm loss": reporting}


def forward_step(data_iterator, model: GPTModel):
    batch = _batch(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


if __name__ == "__main__":
    train_valid_test_datasets_provider.is_distributed = True
    args = parse_and_validate_args()
    pretrain(pretrain_cfg_container_from_args(args), train_valid_test_datasets_provider,
             ModelType.encoder_or_decoder, forward_step, model_provider=model_provider)
