"""How packed weights are held (specdec.few_rows): only the layers a budget allows hold a packed
copy, the largest first; the others keep ``F.linear`` inside a packed pass; results record the
budget and the bytes the copies hold."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specdec import few_rows as fr
from specdec.few_rows import few_rows, install, linear_bytes, pack_layers, packed_bytes, packing_available, set_pack_budget

needs_packing = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN packed inner product")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32), nn.GELU(), nn.Linear(32, 8))


def test_the_budget_takes_the_largest_layers_that_fit():
    model = _model()
    sizes = [m.weight.nbytes for m in model if isinstance(m, nn.Linear)]  # 64*96, 96*32, 32*8 floats
    total = linear_bytes(model)
    assert total == sum(sizes)
    assert pack_layers(model, 1.0) == [model[0], model[2], model[4]]
    assert pack_layers(model, 0.0) == []
    assert pack_layers(model, sizes[0] / total) == [model[0]]
    # the largest does not fit: the next ones still may
    assert pack_layers(model, (sizes[1] + sizes[2]) / total) == [model[2], model[4]]
    for bad in (-0.1, 1.5, "0.5", True, None):
        with pytest.raises(ValueError, match="budget"):
            pack_layers(model, bad)


@needs_packing
def test_only_layers_within_the_budget_hold_copies_and_the_others_keep_f_linear(monkeypatch):
    model = _model()
    set_pack_budget(model, 0.66)  # the first layer (6144 of 9472 floats), neither other (3072, 256)
    packed = []
    real = fr._packed
    monkeypatch.setattr(fr, "_packed", lambda flat, m: packed.append(m) or real(flat, m))
    fr.measure(model, row_counts=(4,), reps=1)
    assert model[0] in fr._PACKED and model[2] not in fr._PACKED and model[4] not in fr._PACKED
    assert packed_bytes(model) == fr._PACKED[model[0]][1].nbytes  # one copy (blocked: padded a little)
    x = torch.randn(4, 64)
    with torch.inference_mode():
        want = model(x)
        install(model)
        packed.clear()
        with few_rows({4: "packed"}):
            got = model(x)
    assert packed == [model[0]]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    set_pack_budget(model, 0.0)  # a smaller budget drops the copies at once
    assert packed_bytes(model) == 0
    assert fr.pack_budget(model) == 0.0


def test_a_target_holds_the_default_budget_and_records_it():
    from specdec.target import Target
    from specdec.testing.tiny import tiny_model

    model = tiny_model("llama", vocab_size=48, seed=3)
    target = Target(model)
    assert fr.pack_budget(model) == fr.PACK_BUDGET
    record = fr.plan_record(model)
    assert record["pack_budget"] == fr.PACK_BUDGET and record["packed_mib"] <= fr.PACK_BUDGET * record["linear_mib"]
    assert fr.plan_key(model)["pack_budget"] != fr.plan_key(_model())["pack_budget"]  # plans tuned per budget
    Target(model, pack_budget=0.5)
    assert fr.pack_budget(model) == 0.5
    with pytest.raises(ValueError, match="budget"):
        Target(model, pack_budget=2.0)
    assert target.pack
