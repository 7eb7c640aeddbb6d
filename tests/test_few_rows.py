"""The few-row product of linear layers (specdec.few_rows): the same values as ``F.linear`` up to
rounding, taken only inside its block, for the row counts it names, of float32 on the CPU; which
row counts is measured per model and thread count, or pinned."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from specdec import few_rows as fr
from specdec.few_rows import FEW_ROWS, MARGIN, few_rows, install, pin, rows_for


class _Calls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", ""))
        return func(*args, **(kwargs or {}))


def _model(dtype=torch.float32, bias=True) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40, bias=bias), nn.GELU(), nn.Linear(40, 16, bias=bias)).to(dtype)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 24), (2, 24), (1, 5, 24), (2, 4, 24), (3, 3, 24), (9, 24)])
def test_values_match_f_linear(shape, bias):
    model = _model(bias=bias)
    x = torch.randn(shape)
    with torch.no_grad():
        want = model(x)
        assert install(model) == 2
        with few_rows(range(1, 10)):
            got = model(x)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows, inside, product", [
    (1, True, "mm"), (2, True, "mm"), (FEW_ROWS, True, "mm"), (3, True, "linear"), (FEW_ROWS + 1, True, "linear"),
    (1, False, "linear"), (2, False, "linear"),
])
def test_the_product_is_taken_only_inside_for_the_rows_it_names(rows, inside, product):
    """Inside ``few_rows({1, 2, FEW_ROWS})`` only those row counts take ``W @ xᵀ`` (one row padded)."""
    model = _model()
    install(model)
    calls = _Calls()
    x = torch.randn(rows, 24)
    with torch.no_grad():
        want = model(x)
        with (few_rows({1, 2, FEW_ROWS}) if inside else torch.no_grad()), calls:
            got = model(x)
    products = [n for n in calls.names if n in ("linear", "mm")]
    assert products == [product, product]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_other_dtypes_fall_back():
    model = _model(torch.bfloat16)
    install(model)
    calls = _Calls()
    with torch.no_grad(), few_rows({3}), calls:
        model(torch.randn(3, 24, dtype=torch.bfloat16))
    assert [n for n in calls.names if n in ("linear", "mm")] == ["linear", "linear"]


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_rows_are_chosen_by_measurement_once_per_thread_count(monkeypatch, threads):
    """``W @ xᵀ`` only where it measured at least MARGIN faster; measured once per thread count."""
    calls = []

    def fake(model):
        calls.append(torch.get_num_threads())
        mm_share = {1: 0.5, 2: 1 - MARGIN, 3: 1 - MARGIN / 2, 4: 2.0, 5: 0.8}
        return {r: (1.0, share) for r, share in mm_share.items()}

    monkeypatch.setattr(fr, "measure", fake)
    model = _model()
    torch.set_num_threads(1)
    assert rows_for(model) == {1, 2, 5} and rows_for(model) == {1, 2, 5} and calls == [1]
    torch.set_num_threads(2)
    assert rows_for(model) == {1, 2, 5} and calls == [1, 2]
    assert rows_for(_model(torch.bfloat16)) == frozenset() and calls == [1, 2]  # nothing to measure
    pin(model, [3])
    assert rows_for(model) == {3} and calls == [1, 2]


def test_measure_times_both_products_for_every_row_count_and_leaves_the_random_stream_alone():
    model = _model()
    torch.manual_seed(7)
    want = torch.rand(3)
    torch.manual_seed(7)
    times = fr.measure(model, max_rows=3, reps=1)
    assert torch.equal(torch.rand(3), want)
    assert sorted(times) == [1, 2, 3] and all(a > 0 and b > 0 for a, b in times.values())


def test_pin_refuses_bad_rows():
    for bad in ([0], [1.5], ["2"]):
        with pytest.raises(ValueError, match="positive integers"):
            pin(_model(), bad)


def test_install_is_idempotent_and_keeps_subclasses_and_state():
    class Custom(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 4), Custom(4, 4))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert install(model) == 1 and install(model) == 1
    first = model[0].forward
    install(model)
    assert model[0].forward is first and "forward" not in model[1].__dict__
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_the_block_ends_on_error():
    model = _model()
    install(model)
    with pytest.raises(RuntimeError, match="inside"), few_rows({3}):
        raise RuntimeError("inside")
    calls = _Calls()
    with torch.no_grad(), calls:
        model(torch.randn(3, 24))
    assert [n for n in calls.names if n in ("linear", "mm")] == ["linear", "linear"]


@pytest.mark.parametrize("fast, rows", [(True, {3}), (True, {2}), (False, {3})], ids=["fast", "other-rows", "general"])
def test_the_target_verifies_a_block_with_it_only_on_its_fast_path(fast, rows):
    """A verified block of 3 tokens goes through ``W @ xᵀ`` in every linear layer (LM head
    included) with the fast paths on and 3 rows chosen for this model, and through ``F.linear``
    otherwise, or outside the target's forward (the same model called directly)."""
    from transformers import DynamicCache

    from specdec.target import Target
    from specdec.testing.tiny import tiny_model

    model = tiny_model("llama", vocab_size=48, init_scale=0.2, seed=3)
    target = Target(model, fast=fast)
    pin(model, rows)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    session = target.new_session(1)
    target.prefill(session, [[1, 2, 3, 4]])
    calls = _Calls()
    with calls:
        logits = target.forward(session, torch.tensor([[5, 6, 7]])).logits
    used = [n for n in calls.names if n in ("linear", "mm")]
    assert used == ["mm" if fast and 3 in rows else "linear"] * linears
    calls = _Calls()
    with torch.inference_mode(), calls:
        want = model(input_ids=torch.tensor([[1, 2, 3, 4, 5, 6, 7]]), cache=DynamicCache()).logits[:, 4:]
    assert "mm" not in calls.names
    torch.testing.assert_close(logits, want.float(), rtol=1e-4, atol=1e-4)


def test_a_target_whose_machine_chose_nothing_leaves_its_layers_alone():
    """Where ``W @ xᵀ`` measured faster for no row count, the layers keep their own forward (no
    wrapper to pay for); once some row count takes it, the wrapper is installed, once."""
    from specdec.target import Target
    from specdec.testing.tiny import tiny_model

    model = tiny_model("llama", vocab_size=48, seed=3)
    target = Target(model)
    pin(model, [])
    session = target.new_session(1)
    target.prefill(session, [[1, 2, 3]])
    target.forward(session, torch.tensor([[4, 5]]))
    target.commit(session)
    assert not any("forward" in m.__dict__ for m in model.modules() if type(m) is nn.Linear)
    pin(model, [2])
    target.forward(session, torch.tensor([[6, 7]]))
    wrapped = [m.__dict__.get("forward") for m in model.modules() if type(m) is nn.Linear]
    assert all(isinstance(f, fr._FewRowForward) for f in wrapped)
