"""EAGLE-3's batched training-time test against the per-sequence reference, and its two attention paths."""

from __future__ import annotations

import pytest
import torch

from specdec.drafters.eagle3.drafter import Eagle3Drafter
from specdec.drafters.eagle3.train import batched_ttt_loss, sample_anchors, ttt_keys_allowed, ttt_loss
from specdec.target import Target
from specdec.testing.tiny import tiny_model
from specdec.training.data import Batch, target_features
from specdec.training.recipe import batch_anchors

STEPS = 4


@pytest.fixture(scope="module")
def setup():
    """A tiny target, a drafter over 3/4 of its vocabulary (some labels fall outside) and a batch of
    three rows of different lengths and response starts, right-padded."""
    target = Target(tiny_model("llama", vocab_size=32, init_scale=0.3, seed=3, num_hidden_layers=8))
    d = Eagle3Drafter.tiny(target, seed=2)
    g = torch.Generator().manual_seed(0)
    lengths, starts = [17, 11, 14], [5, 0, 9]
    tokens = torch.zeros(3, max(lengths), dtype=torch.long)
    for b, n in enumerate(lengths):
        tokens[b, :n] = torch.randint(0, 32, (n,), generator=g)
    feats = target_features(target, tokens, d.model.spec.layer_ids)
    batch = Batch(tokens, torch.tensor(lengths), torch.tensor(starts), feats)
    head = target.lm_head.weight.detach()[d.model.draft_ids].float()
    return target, d.model, batch, head


def _reference(model, target, batch, head, anchors_per_row):
    """The per-sequence loop: ttt_loss on each row (cut to its length), loss averaged over the rows."""
    total, counts = 0.0, torch.zeros(3, STEPS, dtype=torch.long)
    for b, anchors in enumerate(anchors_per_row):
        r = ttt_loss(model, target.embed, head, model.t2d, batch.feature_seq(b), anchors, STEPS)
        total = total + r.loss / len(anchors_per_row)
        counts += torch.tensor([r.correct, r.counted, r.chain])
    return total, counts


def _grads(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params)


def test_batched_ttt_over_every_position_equals_the_per_sequence_loss(setup):
    """Every response position of every row in one pass: the same loss, gradients and counts as the
    per-sequence reference with every position of each row's range as an anchor."""
    target, model, batch, head = setup
    anchors = [sample_anchors(batch.feature_seq(b), 10_000, torch.Generator()) for b in range(3)]
    assert [a.numel() for a in anchors] == [13, 10, 6]  # every slot from response_start-2 to length-2
    ref, counts = _reference(model, target, batch, head, anchors)
    r = batched_ttt_loss(model, target.embed, head, model.t2d, batch, None, STEPS)
    torch.testing.assert_close(r.loss, ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(torch.stack([r.correct, r.counted, r.chain]), counts)
    assert int(r.counted[0]) > 20  # the rows' ranges, less the labels outside the draft vocabulary
    for a, b in zip(_grads(model, r.loss), _grads(model, ref)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))  # summation order


def test_batched_ttt_at_sampled_anchors_equals_the_per_sequence_loss(setup):
    """The sampled-anchor option: the same loss and gradients as the reference at the same anchors,
    rows with fewer anchors than asked padded and left out."""
    target, model, batch, head = setup
    span = lambda s, n: ((s - 2).clamp(min=0), n - 2)  # noqa: E731
    slots, keep = batch_anchors(batch.response_start, batch.lengths, 8, torch.Generator().manual_seed(1), span)
    assert keep.sum(1).tolist() == [8, 8, 6]
    ref, counts = _reference(model, target, batch, head, [slots[b][keep[b]] for b in range(3)])
    r = batched_ttt_loss(model, target.embed, head, model.t2d, batch, slots, STEPS, keep=keep)
    torch.testing.assert_close(r.loss, ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(torch.stack([r.correct, r.counted, r.chain]), counts)
    for a, b in zip(_grads(model, r.loss), _grads(model, ref)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))  # summation order


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_block_mask_and_split_attention_equal_the_dense_sdpa_mask(setup):
    """flex_attention's block mask, SDPA's dense boolean mask and the split context/diagonal scores
    give the same TTT (forward: flex has no CPU backward), densely and at sampled anchors; the dense
    mask is the causal context plus the diagonal of each step. The split path's gradients equal SDPA's."""
    target, model, batch, head = setup
    allowed = ttt_keys_allowed(torch.arange(4).unsqueeze(0), 4, 3)[0]
    assert allowed.int().tolist() == [[1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0], [1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0],
                                       [1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0], [1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1]]
    slots, keep = batch_anchors(batch.response_start, batch.lengths, 5, torch.Generator().manual_seed(2),
                                lambda s, n: ((s - 2).clamp(min=0), n - 2))
    with torch.no_grad():
        for sl, kp in ((None, None), (slots, keep)):
            dense = batched_ttt_loss(model, target.embed, head, model.t2d, batch, sl, STEPS, attention="sdpa", keep=kp)
            for other in ("flex", "split"):
                r = batched_ttt_loss(model, target.embed, head, model.t2d, batch, sl, STEPS, attention=other, keep=kp)
                torch.testing.assert_close(r.loss, dense.loss, rtol=1e-5, atol=1e-6)
                for a, b in zip(r.logits, dense.logits):  # fp32 sums reordered over 4 steps: ~5e-6 of the scale
                    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))
    split = batched_ttt_loss(model, target.embed, head, model.t2d, batch, slots, STEPS, attention="split", keep=keep)
    dense = batched_ttt_loss(model, target.embed, head, model.t2d, batch, slots, STEPS, attention="sdpa", keep=keep)
    for a, b in zip(_grads(model, split.loss), _grads(model, dense.loss)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))
