#!/usr/bin/env python
"""Pretrain GPT on megatron-core with SDP4Bit's quantized communication.

    torchrun --nproc-per-node 8 pretrain_gpt.py <Megatron-LM flags> \\
        --use-distributed-optimizer --quantized-weights --quantized-gradients --hadamard-transform

Reads top to bottom: parse -> config -> what this machine has -> init distributed -> check
inputs -> build -> install -> loop. See ``python pretrain_gpt.py --help`` for every flag. A bad flag, file or
checkpoint stops every rank with one line (``--debug`` adds the traceback).
"""

from __future__ import annotations

import os
import sys
import time
import traceback

from megatron.sdp4bit.training.observe.noise import announce, quiet_megatron_core

quiet_megatron_core()  # before megatron-core's first import: its noise fires on import

from megatron.sdp4bit.training.cli.arguments import ArgumentsError, parse_args, sdp4bit_config_from_args  # noqa: E402
from megatron.sdp4bit.training.observe.logging import format_arguments  # noqa: E402
from megatron.sdp4bit.training.guards import exit_signal  # noqa: E402


def _fail(message: str, code: int, debug: bool = False) -> int:
    """A parse error, the same on every rank: one line from rank 0; the other ranks wait a
    moment so that torchrun, which stops the job when the first worker exits, does not cut
    rank 0 off before it prints."""
    if debug:
        traceback.print_exc()
    if os.environ.get("RANK", "0") == "0":
        print(f"pretrain_gpt.py: error: {message}", file=sys.stderr, flush=True)
    else:
        time.sleep(3)
    return code


def _report(err: BaseException, debug: bool, lost_peer: bool = False) -> int:
    """A run's error: printed once per job, by rank 0 when every rank has it, else by the
    rank that has it (training/guards/errors.py)."""
    from megatron.sdp4bit.training.guards import errors

    if debug:
        traceback.print_exc()
    message = str(err).splitlines()[0] if str(err) else type(err).__name__
    if lost_peer:
        message = f"lost the connection to another rank ({message}); its error is above"
    errors.report(message, int(os.environ.get("RANK", "0")), lost_peer=lost_peer)
    return 1


def _remove_if_unused(folder: str) -> None:
    """A refused run leaves no ``--save`` folder behind that it made itself: removed again
    while it holds nothing but the run's lock."""
    try:
        names = os.listdir(folder)
        if set(names) <= {".lock"}:
            for name in names:
                os.remove(os.path.join(folder, name))
            os.rmdir(folder)
    except OSError:
        pass  # it holds something after all, or is gone: leave it as it is


def main(argv: list[str] | None = None) -> int:
    try:  # the flags, and what this machine lacks for them, before any process group exists
        args = parse_args(argv, check_machine=True)
    except ArgumentsError as err:
        return _fail(str(err), 2)
    # --exit-signal-handler: from here to the process's end the signal only asks for a save
    # at the end of an iteration; one that comes after the loop changes nothing (the run is
    # ending anyway). Never released: a signal in the moment between a release and the exit
    # would kill a rank that has finished.
    signal_handler = exit_signal.install(args.exit_signal)
    sdp4bit_config = sdp4bit_config_from_args(args)
    if os.environ.get("RANK", "0") == "0":
        print(format_arguments(args), flush=True)  # Megatron-LM's arguments dump

    from megatron.sdp4bit.training import build, loop, sdp4bit_setup, tokenizers
    from megatron.sdp4bit.training.guards import faults, preflight

    faults.install()  # the reliability tests' $SDP4BIT_FAULT; nothing without it

    lock = watchdog = None
    # rank 0 makes --save (the input checks, the lock): whether this run is the one that does
    new_save = bool(args.save) and os.environ.get("RANK", "0") == "0" and not os.path.lexists(
        args.save)
    refused = False
    try:
        announce(f"initializing torch.distributed: {args.world_size} process(es)")
        build.init_distributed(args)
        watchdog = build.start_watchdog(args)
        preflight.verify_inputs(args, tokenizers.build_tokenizer)
        ranks_per_node = sdp4bit_config.dp_ranks_per_node or build.detect_dp_ranks_per_node()
        sdp4bit_config = sdp4bit_config.replace(dp_ranks_per_node=ranks_per_node)
        build.print_topology(args, ranks_per_node)
        lock = build.claim_save_dir(args)
        announce("building the model, the optimizer and the datasets")
        state, _ = build.build_state(args, sdp4bit_config)
        sdp4bit_setup.install(sdp4bit_config, state,
                              allow_untested_version=args.allow_untested_megatron_core)
        build.restore(args, state)
        announce(f"training iterations {state.iteration + 1} to {args.train_iters}, a log "
                 f"line every {args.log_interval}")
        loop.train(args, state, exit_signal=signal_handler)
        sdp4bit_setup.uninstall(args, state)
        sdp4bit_setup.print_summary(args, state)
    except build.USER_ERRORS as err:
        refused = True
        return _report(err, args.debug)
    except (RuntimeError, OSError) as err:
        from megatron.sdp4bit.training.guards.errors import is_lost_peer

        if not is_lost_peer(err):
            raise
        # A peer failed (its own error is printed once) or vanished: no traceback here.
        return _report(err, args.debug, lost_peer=True)
    finally:
        if lock is not None:
            lock.release()
        if refused and new_save:
            _remove_if_unused(args.save)
        build.teardown(watchdog)
    return 0


def _exit(code: int) -> None:
    """Exit without the interpreter's finalization. Everything the run holds is closed in
    order by then (metrics files, checkpoint writes, the lock, the watchdog's threads, the
    process groups); what is left is tearing down torch's and megatron-core's modules, which
    takes 1-3 s per rank on an idle 2-core machine (measured: a job of 4 ranks ended 8 s
    after the last rank's main returned, 3 s with this), and is where C++ destructors of
    threads run at exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
