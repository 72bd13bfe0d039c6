"""The auxiliary losses of MoE routers, logged as Megatron-LM logs them.

megatron-core's routers record their load-balancing and z losses per layer in a tracker
(``moe_utils``); Megatron-LM's trainer calls ``track_moe_metrics`` after every iteration,
which reduces them across ranks (collective: every rank calls it), scales them by
1 / micro-batches and sums them into its loss dictionary under ``load_balancing_loss``
(``seq_load_balancing_loss``, ``global_load_balancing_loss``) and ``z_loss``, averaged over the
MoE layers. The console line shows their average over the log interval (`` load_balancing_loss:
1.234560E+00 |``), TensorBoard and W&B get them under the same names as tags.
"""

from __future__ import annotations

import argparse

from megatron.sdp4bit.training.cli.moe_flags import moe_track_names


class MoELosses:
    """Accumulates the routers' auxiliary losses between two log lines."""

    def __init__(self, args: argparse.Namespace) -> None:
        self._args = args
        self.names = moe_track_names(args)
        self._totals: dict = {}

    def after_iteration(self, iteration: int, num_microbatches: int) -> None:
        """Collective: every rank, after every training iteration (of ``num_microbatches``
        micro-batches: the routers' losses were recorded once per micro-batch)."""
        if not self.names:
            return
        from megatron.core.transformer.moe.moe_utils import track_moe_metrics

        args = self._args
        track_moe_metrics(loss_scale=1.0 / num_microbatches, iteration=iteration,
                          total_loss_dict=self._totals, force_initialize=True,
                          track_names=self.names, num_layers=args.num_layers,
                          moe_layer_freq=args.moe_layer_freq)

    def take(self, iterations: int) -> dict:
        """The averages since the last call, by Megatron-LM's names (and ``moe_losses``,
        the names in order); resets them."""
        if not self.names:
            return {}
        out = {name: float(self._totals[name]) / max(iterations, 1)
               for name in self.names if name in self._totals}
        self._totals = {}
        return {**out, "moe_losses": [name for name in self.names if name in out]}
