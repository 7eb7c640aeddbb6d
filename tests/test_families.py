"""Draft networks with their own layers on every target family: built like the target's last
layer (full attention in every supported family, as the draft layers attend to the whole
context), they take its heads, head size and RoPE. Gemma 3 and 4 keep one RoPE per layer type
(10⁴ for sliding layers, 10⁶ for full ones, Gemma 4's proportional), which a Llama config copied
as it is would ignore, falling back to 10⁴."""

from __future__ import annotations

import pytest
import torch

from specdec.registry import DRAFTERS
from specdec.target import Target
from specdec.testing.tiny import FAMILIES, tiny_model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_target(request) -> Target:
    return Target(tiny_model(request.param, vocab_size=32))


@pytest.mark.parametrize("name", ["eagle3", "dflash", "dspark"])
def test_draft_layers_take_the_rope_of_the_layer_they_imitate(family_target, name):
    t = family_target
    model = DRAFTERS.get(name).tiny(t).model
    last = t.layer_specs()[-1]
    x, pos = torch.zeros(1), torch.arange(0, 400, 9).unsqueeze(0)
    for got, want in zip(model.rope(x, pos), t.rotary(x, pos, last.layer_type)):  # [1, m, head size] each
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("groups", [1, 3])
def test_drafting_attention_reads_grouped_heads_with_the_training_values(groups):
    """``attend`` without gradients (drafting: ``enable_gqa``, no copy of the cache) gives the bits
    that the repeated heads give where gradients are recorded (training)."""
    from specdec.drafters.layers import attend

    g = torch.Generator().manual_seed(groups)
    q = torch.randn(2, 2 * groups, 5, 8, generator=g)
    k, v = torch.randn(2, 2, 40, 8, generator=g), torch.randn(2, 2, 40, 8, generator=g)
    allowed = torch.rand(2, 5, 40, generator=g) < 0.7
    allowed[..., 0] = True
    with torch.enable_grad():
        trained = attend(q.requires_grad_(), k, v, allowed)
    with torch.inference_mode():
        drafted = attend(q, k, v, allowed)
    assert torch.equal(drafted, trained.detach())
