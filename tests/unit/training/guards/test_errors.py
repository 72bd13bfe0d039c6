"""Each rank's first error (training/guards/errors.py): printed once, by the rank that has it."""

from __future__ import annotations

from tests.helpers.memory_store import MemoryStore


def test_each_error_is_printed_once_by_the_rank_that_has_it(capsys):
    from megatron.sdp4bit.training.guards import errors

    def lines():
        return capsys.readouterr().err.splitlines()

    store = MemoryStore()
    errors.report("P.bin is truncated", 0, store=store, wait=0.2)  # every rank has it
    errors.report("P.bin is truncated", 2, store=store, wait=0.2)
    assert lines() == ["pretrain_gpt.py: error: P.bin is truncated"]
    store = MemoryStore()  # only ranks 1 and 3 read the broken document
    errors.report("P.idx: bad pointer", 1, store=store, wait=0.2)
    errors.report("P.idx: bad pointer", 3, store=store, wait=0.2)
    assert lines() == ["pretrain_gpt.py: error: rank 1: P.idx: bad pointer"]
    # a rank that lost its peers stays quiet once any error was reported ...
    errors.report("lost the connection to another rank (x)", 2, lost_peer=True,
                  store=store, wait=0.2)
    assert lines() == []
    # ... and speaks when none was (the peer vanished without a word)
    errors.report("lost the connection to another rank (x)", 2, lost_peer=True,
                  store=MemoryStore(), wait=0.2)
    assert lines() == ["pretrain_gpt.py: error: rank 2: lost the connection to another "
                       "rank (x)"]
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error "
                        "[127.0.0.1]:1234: Connection reset by peer")
    assert errors.is_lost_peer(gloo) and not errors.is_lost_peer(ValueError("bad pointer"))
