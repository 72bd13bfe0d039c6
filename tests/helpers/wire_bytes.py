"""What one bucket's quantized collectives send from one rank: the tests' formula (the
accounting of docs/comm.md, computed independently of ``comm.stats``)."""

from __future__ import annotations


def wire(numel: int, bits: int, group: int) -> int:
    """Bytes of one quantized message: packed payload + one fp32 scale per group."""
    assert numel % group == 0
    return numel * bits // 8 + 4 * (numel // group)


def expected_bytes(cfg, numel: int, n: int, m: int) -> dict[str, int]:
    """What one bucket's collectives send from one rank (docs/comm.md accounting)."""
    w = n * m
    s = numel // w
    out = dict.fromkeys(("param_intra_bytes", "param_inter_bytes", "param_intra_bytes_baseline",
                         "param_inter_bytes_baseline", "grad_intra_bytes",
                         "grad_inter_bytes", "grad_intra_bytes_baseline",
                         "grad_inter_bytes_baseline"), 0)
    if cfg.quantized_weights:
        # to the n - 1 ranks of this node and the w - n ranks of the other nodes
        msg = wire(s, cfg.weight_quantization_bits, cfg.wq_group_size)
        out["param_intra_bytes"], out["param_inter_bytes"] = (n - 1) * msg, (w - n) * msg
        out["param_intra_bytes_baseline"] = (n - 1) * s * 2  # bf16 replica
        out["param_inter_bytes_baseline"] = (w - n) * s * 2
    if cfg.quantized_gradients:
        bi, gi = cfg.gradient_quantization_bits_intra, cfg.gq_group_size_intra
        be, ge = cfg.gradient_quantization_bits_inter, cfg.gq_group_size_inter
        if n > 1 and m > 1:
            out["grad_intra_bytes"] = (n - 1) * wire(m * s, bi, gi)
            out["grad_inter_bytes"] = (m - 1) * wire(s, be, ge)
        elif n > 1:
            out["grad_intra_bytes"] = (n - 1) * wire(s, bi, gi)
        else:
            out["grad_inter_bytes"] = (m - 1) * wire(s, be, ge)
        out["grad_intra_bytes_baseline"] = (n - 1) * m * s * 4  # fp32 grads
        out["grad_inter_bytes_baseline"] = (m - 1) * s * 4
    return out
