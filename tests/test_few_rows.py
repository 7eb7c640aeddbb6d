"""The few-row products of linear layers (specdec.few_rows): the same values as ``F.linear`` up to
rounding, taken only inside its block, for the row counts the plan names, of float32 on the CPU
outside autograd; the plan is tuned per model, thread count and packing choice (tests/test_autotune.py), or pinned."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from specdec import few_rows as fr
from specdec.few_rows import MARGIN, MM_ROWS, ROW_COUNTS, choose, few_rows, install, packing_available, pin, plan_for
from specdec.transformers_versions import cache_kwargs

needs_packing = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN packed inner product")


class _Calls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", ""))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def packed_calls(monkeypatch):
    """Records every layer product that went through the packed weights."""
    calls: list[int] = []
    real = fr._packed

    def counting(flat, module):
        calls.append(flat.shape[0])
        return real(flat, module)

    monkeypatch.setattr(fr, "_packed", counting)
    return calls


def _model(dtype=torch.float32, bias=True) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40, bias=bias), nn.GELU(), nn.Linear(40, 16, bias=bias)).to(dtype)


@pytest.mark.parametrize("how", ["mm", pytest.param("packed", marks=needs_packing)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 24), (2, 24), (1, 5, 24), (2, 4, 24), (3, 3, 24), (9, 24)])
def test_values_match_f_linear(shape, bias, how):
    model = _model(bias=bias)
    x = torch.randn(shape)
    with torch.no_grad():
        want = model(x)
        assert install(model) == 2
        with few_rows(dict.fromkeys(range(1, 10), how)):
            got = model(x)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows, inside, product", [
    (1, True, "mm"), (2, True, "mm"), (5, True, "mm"), (3, True, "linear"), (6, True, "linear"),
    (1, False, "linear"), (2, False, "linear"),
])
def test_the_product_is_taken_only_inside_for_the_rows_it_names(rows, inside, product):
    """Inside ``few_rows({1: mm, 2: mm, 5: mm})`` only those row counts take ``W @ xᵀ`` (one row padded)."""
    model = _model()
    install(model)
    calls = _Calls()
    x = torch.randn(rows, 24)
    with torch.no_grad():
        want = model(x)
        with (few_rows({1: "mm", 2: "mm", 5: "mm"}) if inside else torch.no_grad()), calls:
            got = model(x)
    products = [n for n in calls.names if n in ("linear", "mm")]
    assert products == [product, product]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_packing
def test_packed_rows_read_the_packed_copy_and_others_do_not(packed_calls):
    model = _model()
    install(model)
    with torch.no_grad(), few_rows({4: "packed", 2: "mm"}):
        model(torch.randn(4, 24))
        model(torch.randn(2, 24))
        model(torch.randn(3, 24))
    assert packed_calls == [4, 4] and fr.packed_bytes(model) == 4 * (24 * 40 + 40 * 16)


@needs_packing
def test_the_packed_copy_follows_the_weight():
    """An in-place change of the weight (a training step) makes a new packed copy, not a stale product."""
    model = _model()
    install(model)
    x = torch.randn(4, 24)
    with torch.no_grad(), few_rows({4: "packed"}):
        model(x)
        model[0].weight.mul_(2.0)
        got = model(x)
        want = model[2](model[1](F.linear(x, model[0].weight, model[0].bias)))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_other_dtypes_and_autograd_fall_back():
    model = _model(torch.bfloat16)
    install(model)
    calls = _Calls()
    with torch.no_grad(), few_rows({3: "mm"}), calls:
        model(torch.randn(3, 24, dtype=torch.bfloat16))
    assert [n for n in calls.names if n in ("linear", "mm")] == ["linear", "linear"]
    model = _model()
    install(model)
    calls = _Calls()
    with few_rows({3: "mm"}), calls:
        model(torch.randn(3, 24)).sum().backward()  # a training step: the layers' own product, with its gradient
    assert [n for n in calls.names if n in ("linear", "mm")][:2] == ["linear", "linear"]
    assert model[0].weight.grad is not None


def test_choose_takes_the_fastest_product_past_the_margin_and_fills_only_packed():
    times = {
        1: {"linear": 1.0, "mm": 2.0, "packed": 1.1},         # nothing wins
        2: {"linear": 1.0, "mm": 0.5, "packed": 0.6},         # mm, the fastest
        3: {"linear": 1.0, "mm": 1 - MARGIN / 2, "packed": 1.0},  # inside the margin: F.linear
        4: {"linear": 1.0, "mm": 1.0, "packed": 1 - MARGIN},  # exactly at the margin: taken
        5: {"linear": 1.0, "mm": 0.5, "packed": 0.9},         # mm, not extended to 6 and 7
        8: {"linear": 1.0, "packed": 0.5},                    # packed, filled through 15
        16: {"linear": 1.0, "packed": 0.95},
        32: {"linear": 1.0, "packed": 0.5},                   # the last count fills nothing past it
    }
    assert dict(choose(times)) == {2: "mm", 4: "packed", 5: "mm", **dict.fromkeys(range(8, 16), "packed"),
                                   32: "packed"}
    assert dict(choose({})) == {}


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_plans_are_tuned_once_per_thread_count_and_packing_choice(monkeypatch, threads, tmp_path, quiet_machine):
    calls = []

    def fake(model, packed=True):
        calls.append((torch.get_num_threads(), packed))
        return {1: {"linear": 1.0, "mm": 0.5}, 4: {"linear": 1.0, "packed": 0.5} if packed else {"linear": 1.0}}

    monkeypatch.setattr(fr, "measure", fake)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))  # an empty cache: every key is measured
    model = _model()
    torch.set_num_threads(1)
    assert fr.autotune(model) == {1: "mm", 4: "packed"} and calls == [(1, True)]
    assert plan_for(model) == {1: "mm", 4: "packed"} and plan_for(model) is plan_for(model) and calls == [(1, True)]
    assert fr.autotune(model, packed=False) == {1: "mm"} and calls == [(1, True), (1, False)]
    torch.set_num_threads(2)
    assert fr.autotune(model) == {1: "mm", 4: "packed"} and len(calls) == 3
    assert fr.autotune(_model(torch.bfloat16)) == {} and len(calls) == 3  # nothing to measure
    pin(model, {3: "mm"})
    assert plan_for(model) == {3: "mm"} and len(calls) == 3


@needs_packing
def test_packed_copies_no_row_count_takes_are_dropped(monkeypatch, threads, tmp_path, quiet_machine):
    real = fr.measure

    def never_packed(model, packed=True):
        times = real(model, row_counts=(1, 4), reps=1, packed=packed)
        assert fr.packed_bytes(model) > 0  # measuring made the copies
        return {r: {**t, "packed": 10 * t["linear"]} for r, t in times.items()}

    monkeypatch.setattr(fr, "measure", never_packed)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    model = _model()
    assert "packed" not in fr.autotune(model).values() and fr.packed_bytes(model) == 0


def test_measure_times_each_product_where_it_is_considered_and_leaves_the_random_stream_alone():
    model = _model()
    torch.manual_seed(7)
    want = torch.rand(3)
    torch.manual_seed(7)
    times = fr.measure(model, row_counts=(1, MM_ROWS, MM_ROWS + 3), reps=1, packed=packing_available())
    assert torch.equal(torch.rand(3), want)
    packed = ["packed"] if packing_available() else []
    assert {r: sorted(t) for r, t in times.items()} == {
        1: sorted(["linear", "mm", *packed]), MM_ROWS: sorted(["linear", "mm", *packed]),
        MM_ROWS + 3: sorted(["linear", *packed])}
    assert all(s > 0 for t in times.values() for s in t.values())
    assert set(fr.measure(model, row_counts=(2,), reps=1, packed=False)[2]) == {"linear", "mm"}
    assert ROW_COUNTS == tuple(sorted(ROW_COUNTS)) and ROW_COUNTS[0] == 1


@pytest.mark.parametrize("bad, error", [({0: "mm"}, ValueError), ({1.5: "mm"}, ValueError), ({True: "mm"}, ValueError),
                                        ({2: "linear"}, ValueError), ({2: "fast"}, ValueError), ([2], TypeError)])
def test_pin_refuses_bad_plans(bad, error):
    with pytest.raises(error):
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
    with pytest.raises(RuntimeError, match="inside"), few_rows({3: "mm"}):
        raise RuntimeError("inside")
    calls = _Calls()
    with torch.no_grad(), calls:
        model(torch.randn(3, 24))
    assert [n for n in calls.names if n in ("linear", "mm")] == ["linear", "linear"]


@pytest.mark.parametrize("fast, plan", [(True, {3: "mm"}), (True, {2: "mm"}), (False, {3: "mm"})],
                         ids=["fast", "other-rows", "general"])
def test_the_target_verifies_a_block_with_it_only_on_its_fast_path(fast, plan):
    """A verified block of 3 tokens goes through ``W @ xᵀ`` in every linear layer (LM head
    included) with the fast paths on and 3 rows chosen for this model, and through ``F.linear``
    otherwise, or outside the target's forward (the same model called directly)."""
    from transformers import DynamicCache

    from specdec.target import Target
    from specdec.testing.tiny import tiny_model

    model = tiny_model("llama", vocab_size=48, init_scale=0.2, seed=3)
    target = Target(model, fast=fast)
    pin(model, plan)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    session = target.new_session(1)
    target.prefill(session, [[1, 2, 3, 4]])
    calls = _Calls()
    with calls:
        logits = target.forward(session, torch.tensor([[5, 6, 7]])).logits
    used = [n for n in calls.names if n in ("linear", "mm")]
    assert used == ["mm" if fast and 3 in plan else "linear"] * linears
    calls = _Calls()
    with torch.inference_mode(), calls:
        want = model(input_ids=torch.tensor([[1, 2, 3, 4, 5, 6, 7]]), **cache_kwargs(DynamicCache())).logits[:, 4:]
    assert "mm" not in calls.names
    torch.testing.assert_close(logits, want.float(), rtol=1e-4, atol=1e-4)


@needs_packing
@pytest.mark.parametrize("pack", [True, False])
def test_the_target_packs_only_when_allowed_and_its_head_follows_the_plan_for_a_drafters_rows(pack, packed_calls):
    """``Target(pack=False)`` measures without packed copies; a drafter's 5 rows through
    :meth:`Target.logits` take the plan's product like a verified block."""
    from specdec.target import Target
    from specdec.testing.tiny import tiny_model

    model = tiny_model("llama", vocab_size=48, init_scale=0.2, seed=3)
    target = Target(model, pack=pack, pack_budget=1.0)  # every layer may hold a copy (the head is not the largest)
    pin(model, {5: "packed"}, packed=True)
    pin(model, {}, packed=False)
    hidden = torch.randn(1, 5, target.hidden_size)
    want = F.linear(hidden, target.lm_head.weight)
    with torch.inference_mode():  # as a drafter's propose runs it
        got = target.logits(hidden)
    assert packed_calls == ([5] if pack else [])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="pack"):
        Target(model, pack="yes")


def test_a_target_whose_machine_chose_nothing_leaves_its_layers_alone():
    """Where no other product measured faster for any row count, the layers keep their own forward
    (no wrapper to pay for); once some row count takes one, the wrapper is installed, once."""
    from specdec.target import Target
    from specdec.testing.tiny import tiny_model

    model = tiny_model("llama", vocab_size=48, seed=3)
    target = Target(model)
    pin(model, {})
    session = target.new_session(1)
    target.prefill(session, [[1, 2, 3]])
    target.forward(session, torch.tensor([[4, 5]]))
    target.commit(session)
    assert not any("forward" in m.__dict__ for m in model.modules() if type(m) is nn.Linear)
    pin(model, {2: "mm"})
    target.forward(session, torch.tensor([[6, 7]]))
    wrapped = [m.__dict__.get("forward") for m in model.modules() if type(m) is nn.Linear]
    assert all(isinstance(f, fr._FewRowForward) for f in wrapped)


def test_the_load_less_our_own_share_and_when_it_is_busy(monkeypatch):
    monkeypatch.setattr(fr.os, "getloadavg", lambda: (3.0, 2.0, 1.0))
    assert fr.other_load() == 3.0
    assert fr.other_load(own_threads=2, running_s=60) == pytest.approx(3.0 - 2 * (1 - math.exp(-1)))
    assert fr.other_load(own_threads=8, running_s=600) == 0.0
    assert not fr.busy(1, 0.4, cores=2) and not fr.busy(1, 1.5, cores=2) and fr.busy(1, 1.6, cores=2)
    assert fr.busy(2, 0.6, cores=2) and not fr.busy(2, float("nan"), cores=2)


def test_measure_records_the_spread_of_its_repeats_and_the_spot_check_times_only_the_plans_products():
    model = _model()
    times = fr.measure(model, row_counts=(1, 9), reps=3, packed=False)
    assert isinstance(times, fr.Times) and times.repeats == 3
    assert {r: sorted(t) for r, t in times.spreads.items()} == {r: sorted(t) for r, t in times.items()}
    assert fr.spread(times) == max(x for t in times.spreads.values() for x in t.values()) >= 0
    assert fr.spread({1: {"linear": 1.0}}) is None
    checked = fr.spot_check(model, {2: "mm", 17: "packed", 20: "packed"} if fr.packing_available() else {2: "mm"})
    assert set(checked) == {2} and all(s > 0 for pair in checked.values() for s in pair)  # 17, 20: not measured counts
