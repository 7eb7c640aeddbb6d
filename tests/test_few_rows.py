"""The few-row product of linear layers (specdec.few_rows): the same values as ``F.linear`` up to
rounding, taken only inside its block, for 2..max rows of float32 on the CPU."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from specdec.few_rows import FEW_ROWS, few_rows, install


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
        with few_rows():
            got = model(x)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads, rows, inside, product", [
    (1, 1, True, "linear"), (2, 1, True, "mm"), (1, 2, True, "mm"), (1, FEW_ROWS, True, "mm"),
    (2, FEW_ROWS + 1, True, "linear"), (1, 2, False, "linear"), (2, 1, False, "linear"),
], indirect=["threads"])
def test_the_product_is_taken_only_inside_for_few_rows(threads, rows, inside, product):
    """One row takes it only with more than one thread (padded to two rows, it uses them)."""
    model = _model()
    install(model)
    calls = _Calls()
    x = torch.randn(rows, 24)
    with torch.no_grad():
        want = model(x)
        with (few_rows() if inside else torch.no_grad()), calls:
            got = model(x)
    products = [n for n in calls.names if n in ("linear", "mm")]
    assert products == [product, product]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_other_dtypes_and_limits_fall_back():
    model = _model(torch.bfloat16)
    install(model)
    calls = _Calls()
    with torch.no_grad(), few_rows(), calls:
        model(torch.randn(3, 24, dtype=torch.bfloat16))
    assert [n for n in calls.names if n in ("linear", "mm")] == ["linear", "linear"]
    model = _model()
    install(model)
    calls = _Calls()
    with torch.no_grad(), few_rows(max_rows=2), calls:
        model(torch.randn(3, 24))
    assert [n for n in calls.names if n in ("linear", "mm")] == ["linear", "linear"]


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
    with pytest.raises(RuntimeError, match="inside"), few_rows():
        raise RuntimeError("inside")
    calls = _Calls()
    with torch.no_grad(), calls:
        model(torch.randn(3, 24))
    assert [n for n in calls.names if n in ("linear", "mm")] == ["linear", "linear"]


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "general"])
def test_the_target_verifies_a_block_with_it_only_on_its_fast_path(fast):
    """A verified block of 3 tokens goes through ``W @ xᵀ`` in every linear layer (LM head
    included) with the fast paths on, and through ``F.linear`` with them off or outside the
    target's forward (the same model called directly)."""
    from transformers import DynamicCache

    from specdec.target import Target
    from specdec.testing.tiny import tiny_model

    model = tiny_model("llama", vocab_size=48, init_scale=0.2, seed=3)
    target = Target(model, fast=fast)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    session = target.new_session(1)
    target.prefill(session, [[1, 2, 3, 4]])
    calls = _Calls()
    with calls:
        logits = target.forward(session, torch.tensor([[5, 6, 7]])).logits
    used = [n for n in calls.names if n in ("linear", "mm")]
    assert used == ["mm" if fast else "linear"] * linears
    calls = _Calls()
    with torch.inference_mode(), calls:
        want = model(input_ids=torch.tensor([[1, 2, 3, 4, 5, 6, 7]]), cache=DynamicCache()).logits[:, 4:]
    assert "mm" not in calls.names
    torch.testing.assert_close(logits, want.float(), rtol=1e-4, atol=1e-4)
