"""benchmarks/scale.py on a tiny GPT: the wire bytes it reports follow the paper's bits.

The build runs in a process of its own (forked from the session's fork server): it
initializes a fake process group and megatron-core's CPU mode, neither of which this test
process should keep.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from tests.helpers import launch

ROOT = Path(__file__).resolve().parents[2]

_BUILD = """
import json, sys, warnings
warnings.filterwarnings("ignore")
from benchmarks import scale as s
from megatron.sdp4bit.integration.cpu_mode import enable_cpu_mode
enable_cpu_mode()
s.MODELS["tiny"] = (2, 256, 4)
s.SLICES["tiny"] = 2
print("RESULT" + json.dumps(s.build_rank("tiny", 1, 1, 8, 0, 4)))
"""


def test_tiny_gpt_bytes_match_the_bits_per_element(tmp_path):
    script = tmp_path / "build.py"
    script.write_text(_BUILD)
    proc = launch.python(str(script), [], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                         cwd=str(ROOT), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    w, n = 8, 4
    m = w // n
    base, sdp = result["baseline"], result["sdp4bit"]
    assert base["params"] == sdp["params"]
    # Padding: every SDP4Bit bucket is a multiple of W x lcm(2048, P x 128) and exceeds its
    # parameters by less than that.
    unit = w * math.lcm(2048, 2 * 128)
    for numel, unpadded in zip(sdp["bucket_numels"], sdp["bucket_unpadded"]):
        assert numel % unit == 0 and unpadded <= numel < unpadded + unit
    # The main shard holds exactly this rank's share of the parameters (<= 1/W of a bucket).
    assert sdp["main_shard_numel"] <= sum(sdp["bucket_numels"]) // w
    padded = sum(sdp["bucket_numels"])
    shard_total = padded // w
    got = sdp["comm"]["bytes"]
    # Weights: 4 bits + one fp32 scale per 2048 values, to N-1 node peers and W-N others.
    bits_w = 4 + 32 / 2048
    assert got["param_intra_bytes"] == (n - 1) * shard_total * bits_w / 8
    assert got["param_inter_bytes"] == (w - n) * shard_total * bits_w / 8
    # Gradients: intra 8 + 32/128 = 8.25 bits over (N-1) x M shards, inter 4.25 bits over
    # M-1 shards.
    assert got["grad_intra_bytes"] == (n - 1) * m * shard_total * 8.25 / 8
    assert got["grad_inter_bytes"] == (m - 1) * shard_total * 4.25 / 8
    # qWD's transient buffers: one message and W of them on the wire, plus an fp32 scratch.
    for bucket, numel in zip(sdp["comm"]["buckets"], sdp["bucket_numels"]):
        s = numel // w
        assert bucket["qwd_message_bytes"] == s * bits_w / 8
        assert bucket["qwd_extra_bytes"] == (w + 1) * s * bits_w / 8 + 4 * s
        intra, inter = bucket["hops"]
        assert (intra["collectives"], intra["peers"], inter["peers"]) == (2, n, m)
        # TLq-HS: send and receive of the whole bucket at 8.25 bits (P x N messages of M x c)
        # and of M chunks at 4.25 bits (P x M messages of c).
        assert bucket["tlq_extra_bytes"] == 2 * (w * s * 8.25 / 8 + m * s * 4.25 / 8)
