#!/usr/bin/env python
"""Pretrain GPT on megatron-core with SDP4Bit's quantized communication.

    torchrun --nproc-per-node 8 pretrain_gpt.py <Megatron-LM flags> \\
        --use-distributed-optimizer --quantized-weights --quantized-gradients --hadamard-transform

Reads top to bottom: parse -> config -> init distributed -> build -> install -> loop.
See ``python pretrain_gpt.py --help`` for every flag.
"""

from __future__ import annotations

import os
import sys

from megatron.sdp4bit.training.noise import announce, quiet_megatron_core

quiet_megatron_core()  # before megatron-core's first import: its noise fires on import

from megatron.sdp4bit.training.arguments import ArgumentsError, parse_args, sdp4bit_config_from_args  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except ArgumentsError as err:
        if os.environ.get("RANK", "0") == "0":  # one line per launch, not one per rank
            print(f"pretrain_gpt.py: error: {err}", file=sys.stderr)
        return 2
    sdp4bit_config = sdp4bit_config_from_args(args)

    from megatron.sdp4bit.training import build, loop, sdp4bit_setup

    announce(f"initializing torch.distributed: {args.world_size} process(es)")
    build.init_distributed(args)
    try:
        ranks_per_node = sdp4bit_config.dp_ranks_per_node or build.detect_dp_ranks_per_node()
        sdp4bit_config = sdp4bit_config.replace(dp_ranks_per_node=ranks_per_node)
        build.print_topology(args, ranks_per_node)
        announce("building the model, the optimizer and the datasets")
        state, transformer_config = build.build_state(args, sdp4bit_config)
        state.ranks_per_node = ranks_per_node
        handle = sdp4bit_setup.install(sdp4bit_config, state, transformer_config)
        build.restore(args, state)
        announce(f"training iterations {state.iteration + 1} to {args.train_iters}, a log "
                 f"line every {args.log_interval}")
        loop.train(args, state, on_iteration=sdp4bit_setup.iteration_hook(handle))
        sdp4bit_setup.uninstall(args, state, handle)
        sdp4bit_setup.print_summary(args, state, handle)
    finally:
        build.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
