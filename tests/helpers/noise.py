"""Statistics of stochastic rounding, measured on what the quantizers actually wrote.

Shared by the unit, distributed and integration tests (``tests/conftest.py`` puts this folder
on ``sys.path``).

[Note: rounding errors in steps]
A quantizer with scale ``s`` turns ``x`` into the integer ``q = floor(x * (1/s) + u)``. With
``y = x * (1/s)`` (fp32, as every backend computes it) and ``f = y - floor(y)``, stochastic rounding
picks ``ceil`` with probability ``f``: the error in steps ``r = q - y`` has mean 0 and
variance ``f (1 - f)`` given ``x``. Both are read from the wire (codes and scales) next to
the quantizer's input, so the tests measure the backend that ran, whatever it is.

* Unbiasedness: within every bin of ``f`` the mean of ``r`` is 0; its standard error is
  ``sqrt(sum f(1-f)) / n``. A biased ``u`` (e.g. ``0.95 u``) moves the mean by up to 0.05
  of a step where ``f`` is small.
* Independence: two roundings with independent ``u`` (different rank, hop, slice, bucket,
  iteration or call) give ``E[r_a r_b] = 0`` element by element (also when ``x_b`` depends
  on ``r_a``, as long as ``u_b`` is fresh); the sum ``S = sum r_a r_b`` over the elements
  they share has variance ``V = sum v_a v_b``, and ``z = S / sqrt(V)`` is reported. The same
  ``u`` on both gives ``E[r_a r_b] = min(f_a, f_b) - f_a f_b`` > 0, on average 1/12 for spread
  ``f``: ``z`` then grows like ``sqrt(n) / 2`` (about 90 at 32k elements).

[Note: why the independence check is Bernstein's, not a z-limit]
``z`` is close to N(0, 1) only when many terms of comparable variance make up ``V``. Real
inputs are not always so: after Adam's first step every weight difference of a group has the
same magnitude, so nearly every ``f`` is within 1e-5 of 0 or 1 and ``V`` is tiny, made of
terms whose rounding goes the unlikely way with probability ~1e-5. One such event (measured:
``r_a = 0.99999`` where ``f_a = 8.6e-6``, beside an ordinary ``r_b = 0.49``) gave
``z = 13.5`` for independent streams. Every term is bounded, ``|r_a r_b| < 1``, so
Bernstein's inequality holds whatever the inputs: ``P(|S| >= t) <= 2 exp(-t^2 / (2V + 2t/3))``;
the check fails when ``|S|`` exceeds the ``t`` at which that bound is ``ALPHA``
(:func:`independence_limit`). For large ``V`` that is ``~6.5 sqrt(V)``, as strict as the
z-limit; a shared stream, whose ``S`` grows like ``n / 12``, fails it all the same.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from dataclasses import dataclass

import torch

from megatron.sdp4bit.quantization import format as fmt
from megatron.sdp4bit.quantization import ops
from megatron.sdp4bit.quantization.hadamard import hadamard_transform

# |z| above this fails a check of a sum of many comparable terms (the bias bins, a
# reduce-scatter's output error): about 2e-9 two-sided for independent noise, while shared
# noise gives z ~ sqrt(n) / 2.
Z_LIMIT = 6.0
# The false-alarm probability per pair of the independence check (Bernstein's bound, see
# [Note: why the independence check is Bernstein's, not a z-limit]).
ALPHA = 1e-9
# The bias bound of a bin is Z_LIMIT standard errors; tests choose sample sizes so that this
# stays below BIAS_RESOLUTION of a step.
BIAS_RESOLUTION = 0.01


@dataclass
class Rounding:
    """The rounding errors of one quantization call (all fp64, stream order)."""

    label: str
    r: torch.Tensor  # error in steps, q - x/s (0 where s == 0)
    v: torch.Tensor  # its variance f (1 - f)
    f: torch.Tensor  # fractional part of x/s
    messages: int = 1  # equal-sized messages the call wrote, in stream order


def decode(wire: torch.Tensor, count: int, numel: int, bits: int, group_size: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, s)`` of ``count`` messages: signed codes (int64) and each element's scale
    (fp32), both ``[count * numel]`` in stream order."""
    scales, payload = fmt.split_messages(wire, count, numel, bits, group_size)
    q = fmt.unpack_codes(payload, bits).reshape(-1).to(torch.int64) - (fmt.qmax(bits) + 1)
    return q, scales.reshape(-1).repeat_interleave(group_size)


def rounding(label: str, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> Rounding:
    """Errors of codes ``q`` with scales ``s`` for the fp32 quantizer input ``x``."""
    x = x.reshape(-1).to(torch.float32)
    usable = torch.isfinite(s) & (s > 0)
    ones = torch.ones_like(s)
    y = (x * (ones / torch.where(usable, s, ones))).double()  # fp32, as quantized
    f = y - torch.floor(y)
    r = torch.where(usable, q.double() - y, torch.zeros_like(y))
    v = torch.where(usable, f * (1 - f), torch.zeros_like(y))
    return Rounding(label, r, v, f)


def bin_sums(roundings: list[Rounding], bins: int = 10) -> torch.Tensor:
    """fp64 ``[3, bins]``: per bin of ``f``, the sums of ``r`` and of ``v`` and the count of
    roundings that had a choice (``f > 0``). Sums add across ranks (all-reduce them)."""
    r = torch.cat([x.r for x in roundings])
    v = torch.cat([x.v for x in roundings])
    f = torch.cat([x.f for x in roundings])
    index = torch.clamp((f * bins).long(), 0, bins - 1)
    chose = (v > 0).double()
    return torch.stack([torch.bincount(index, weights=w.double(), minlength=bins)
                        for w in (r, v, chose)])


def bias_table(sums: torch.Tensor) -> list[tuple[float, float, float, int]]:
    """Per bin: ``(lower edge, mean r, standard error, count)`` from :func:`bin_sums`."""
    bins = sums.shape[1]
    return [(b / bins, float(sums[0, b]) / max(float(sums[2, b]), 1),
             float(sums[1, b]) ** 0.5 / max(float(sums[2, b]), 1), int(sums[2, b]))
            for b in range(bins)]


def assert_unbiased_sums(sums: torch.Tensor, what: str,
                         resolution: float = BIAS_RESOLUTION) -> None:
    """Every bin's mean error within ``Z_LIMIT`` standard errors of 0, and the sample large
    enough that this resolves ``resolution`` of a step (the test fails otherwise: a weak
    test must not pass silently)."""
    table = bias_table(sums)
    width = 1 / len(table)
    for lower, mean, stderr, n in table:
        assert Z_LIMIT * stderr <= resolution, (
            f"{what}: {n} roundings in f-bin {lower:.1f} resolve only "
            f"{Z_LIMIT * stderr:.4f} of a step (> {resolution}): use more samples")
        assert abs(mean) <= Z_LIMIT * stderr, (
            f"{what}: biased rounding in f-bin [{lower:.1f}, {lower + width:.1f}): mean error "
            f"{mean:+.4f} steps, {abs(mean) / stderr:.1f} standard errors; table {table}")


def assert_unbiased(roundings: list[Rounding], what: str, bins: int = 10,
                    resolution: float = BIAS_RESOLUTION) -> None:
    assert_unbiased_sums(bin_sums(roundings, bins), what, resolution)


def z_score(a: Rounding, b: Rounding) -> float:
    """Correlation z of two roundings over the stream indices they share (see the Note)."""
    n = min(a.r.numel(), b.r.numel())
    num = float((a.r[:n] * b.r[:n]).sum())
    den = float((a.v[:n] * b.v[:n]).sum()) ** 0.5
    return num / den if den > 0 else 0.0


def independence_limit(variance: float, alpha: float = ALPHA) -> float:
    """The ``t`` with ``2 exp(-t^2 / (2 variance + 2t/3)) = alpha``: a sum of independent
    zero-mean terms bounded by 1, of total variance ``variance``, exceeds it in absolute value
    with probability at most ``alpha`` (Bernstein)."""
    c = math.log(2 / alpha)
    return (2 * c / 3 + math.sqrt((2 * c / 3) ** 2 + 8 * c * variance)) / 2


def assert_independent(roundings: list[Rounding], what: str, min_elements: int = 1000,
                       part: tuple[int, int] = (0, 1)) -> int:
    """Every pair's ``|sum r_a r_b|`` below :func:`independence_limit` of its variance;
    returns the number of pairs checked.

    ``part = (i, k)`` checks only every k-th pair starting at the i-th, so that k ranks
    holding the same list share the work."""
    pairs = 0
    for index, (a, b) in enumerate(itertools.combinations(roundings, 2)):
        if index % part[1] != part[0]:
            continue
        n = min(a.r.numel(), b.r.numel())
        if n < min_elements:
            continue
        total = float((a.r[:n] * b.r[:n]).sum())
        variance = float((a.v[:n] * b.v[:n]).sum())
        limit = independence_limit(variance)
        assert abs(total) < limit, (
            f"{what}: the rounding noise of {a.label} and {b.label} is correlated (sum of "
            f"products {total:.3g} beyond {limit:.3g}, z = {z_score(a, b):.1f}, over {n} "
            "elements)")
        pairs += 1
    return pairs


def assert_messages_independent(roundings: list[Rounding], what: str,
                                min_elements: int = 1000) -> int:
    """Within each call, every pair of its messages uncorrelated (:func:`assert_independent`): one
    call's stream continues across the messages it writes, so a stream that restarts in
    every message gives each destination the same uniforms. Returns the pairs checked."""
    pairs = 0
    for x in roundings:
        if x.messages < 2:
            continue
        size = x.r.numel() // x.messages
        if size < min_elements:
            continue
        parts = [Rounding(f"{x.label}/message{j}", x.r[j * size:(j + 1) * size],
                          x.v[j * size:(j + 1) * size], x.f[j * size:(j + 1) * size])
                 for j in range(x.messages)]
        pairs += assert_independent(parts, what, min_elements)
    return pairs


# ------------------------------------------------------------------- recording quantizers


def dequantized_sum(wire: torch.Tensor, n_in: int, numel: int, bits: int, group_size: int
                     ) -> torch.Tensor:
    """fp32 sum in message order from +0 of ``n_in`` messages: what tlq_middle requantizes."""
    q, s = decode(wire, n_in, numel, bits, group_size)
    values = (q.to(torch.float32) * s).view(n_in, numel)
    total = torch.zeros(numel)
    for row in values:
        total += row
    return total


def sender_values(inp, num_dests, blocks_per_dest, slices, hadamard_block) -> torch.Tensor:
    """tlq_sender's quantizer input in stream order (message-major), fp32."""
    values = inp.reshape(blocks_per_dest, num_dests, slices, -1)
    values = hadamard_transform(values, hadamard_block) if hadamard_block else values.float()
    return values.permute(2, 1, 0, 3).reshape(-1)


class Recorder:
    """Records every stochastic quantization the process makes through
    :mod:`megatron.sdp4bit.quantization.ops` (whichever backend runs it) as a
    :class:`Rounding`, labelled by ``tag`` (set by the test) and a call counter."""

    def __init__(self) -> None:
        self.roundings: list[Rounding] = []
        self.tag = ""
        self._count = 0

    def _add(self, op: str, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
             messages: int = 1) -> None:
        self._count += 1
        record = rounding(f"{self.tag}{op}#{self._count}", x, q, s)
        record.messages = messages
        self.roundings.append(record)

    @contextlib.contextmanager
    def active(self):
        originals = {name: getattr(ops, name)
                     for name in ("qwd_sender", "tlq_sender", "tlq_middle")}

        def qwd_sender(main_shard, replica_shard, out, *, bits, group_size, stochastic, seed,
                       **kw):
            originals["qwd_sender"](main_shard, replica_shard, out, bits=bits,
                                    group_size=group_size, stochastic=stochastic, seed=seed, **kw)
            if stochastic:
                x = main_shard.reshape(-1).float()
                if replica_shard is not None:
                    x = x - replica_shard.reshape(-1).float()
                self._add("qwd_sender", x, *decode(out, 1, x.numel(), bits, group_size))

        def tlq_sender(inp, out, *, num_dests, blocks_per_dest, slices, bits, group_size,
                       hadamard_block, stochastic, seed, **kw):
            x = sender_values(inp, num_dests, blocks_per_dest, slices, hadamard_block)
            originals["tlq_sender"](inp, out, num_dests=num_dests,
                                    blocks_per_dest=blocks_per_dest, slices=slices, bits=bits,
                                    group_size=group_size, hadamard_block=hadamard_block,
                                    stochastic=stochastic, seed=seed, **kw)
            if stochastic:
                count = num_dests * slices
                self._add("tlq_sender", x, *decode(out, count, x.numel() // count, bits,
                                                   group_size), messages=count)

        def tlq_middle(wire_in, out, *, n_in, numel, bits_in, group_size_in, n_out, bits_out,
                       group_size_out, stochastic, seed, **kw):
            x = dequantized_sum(wire_in, n_in, numel, bits_in, group_size_in)
            originals["tlq_middle"](wire_in, out, n_in=n_in, numel=numel, bits_in=bits_in,
                                    group_size_in=group_size_in, n_out=n_out,
                                    bits_out=bits_out, group_size_out=group_size_out,
                                    stochastic=stochastic, seed=seed, **kw)
            if stochastic:
                self._add("tlq_middle", x, *decode(out, n_out, numel // n_out, bits_out,
                                                   group_size_out), messages=n_out)

        replacements = {"qwd_sender": qwd_sender, "tlq_sender": tlq_sender,
                        "tlq_middle": tlq_middle}
        for name, fn in replacements.items():
            setattr(ops, name, fn)
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(ops, name, fn)


def gather_roundings(roundings: list[Rounding], group=None,
                     max_elements: int = 1 << 15) -> list[Rounding]:
    """Every rank's roundings (labels prefixed with the rank), on every rank, each cut to its
    first ``max_elements`` stream indices (the pairs compare there; 32k elements already put
    shared noise at z ~ 90) and sent as fp32 to keep memory small."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    mine = [(f"rank{rank}:{x.label}", x.r[:max_elements].float(), x.v[:max_elements].float(),
             x.f[:max_elements].float()) for x in roundings]
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return [Rounding(label, r.double(), v.double(), f.double())
            for entries in everyone for label, r, v, f in entries]
