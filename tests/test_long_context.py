"""Long-context bookkeeping: the KV store says what it holds, and a drafter's pass over
the prompt counts as prefill, not as drafting."""

from __future__ import annotations

import torch

from specdec.kv import KVStore
from specdec.loop import Request, run
from specdec.verifiers import GreedyVerifier


def test_the_store_says_what_its_buffers_hold():
    store = KVStore(2, "cpu", torch.float32, num_layers=3)
    assert store.nbytes == 0  # nothing before a reservation
    store.reserve(10)
    assert store.nbytes == 2 * 10 * (1 + 8)  # valid (bool) and slot_pos (int64) only: K/V come at the first write
    with torch.inference_mode():
        store.plan(length=4)
        for i in range(3):
            store.write(i, torch.zeros(2, 5, 4, 6), torch.zeros(2, 5, 4, 7))
        store.commit()
    assert store.capacity == 10 and store.nbytes == 2 * 10 * (9 + 3 * 5 * (6 + 7) * 4)


def test_a_drafters_pass_over_the_prompt_is_prefill(target, monkeypatch):
    from specdec.drafters.eagle3.drafter import Eagle3Drafter

    d = Eagle3Drafter.tiny(target)
    real = d.start

    def slow_start(prefill, rows):  # a pass over the prompt that takes a known, large share of the run
        import time

        time.sleep(0.5)
        return real(prefill, rows)

    monkeypatch.setattr(d, "start", slow_start)
    rm = run(target, d, GreedyVerifier(), [Request([1, 2, 3, 4, 5], 4)], k=2, eos_token_ids=set()).metrics
    assert rm.prefill_s >= 0.5  # the sleep is in the prefill; before, it was counted as drafting
    assert rm.draft_s < 0.5  # two draft steps of a tiny model: nowhere near the sleep
