"""The target feature store (specdec.data.store): one target pass, read by every recipe.

On a tiny random target: a store round-trips what the target computes; it resumes and refuses a
folder made for another target or other layers; two processes fill the same store one process
does; and every recipe trained from a store ends where the same recipe trained online (the target
run inside the loop) on the same tokens ends, without the target running.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from accelerate import debug_launcher
from accelerate.state import AcceleratorState
from safetensors.torch import load_file

from specdec.data.sequences import TokenSeq, held_out_seq, save_sequences
from specdec.data.store import (FeatureStore, StoreItem, StoreMismatch, StoreNeeds, StoredRow, forward_with_kv,
                                store_bytes_per_token, target_kv, throughput, weights_hash, write_store)
from specdec.target import Target
from specdec.testing.tiny import tiny_model
from specdec.training.config import DataConfig, OptimConfig, TrainConfig
from specdec.training.data import load_data
from specdec.training.trainer import train

V = 32
EVERY = 4
RECIPES = {
    "eagle3": ("specdec.drafters.eagle3.train.Eagle3Recipe", dict(layer_ids=[0, 1, 2], draft_vocab=24, anchors=4)),
    "dflash": ("specdec.drafters.dflash.train.DFlashRecipe", dict(layers=1, intermediate=32, features=2, block=4,
                                                                  anchors=4, loss="kl")),
    "dflash2": ("specdec.drafters.dflash2.train.DFlash2Recipe", dict(layers=1, intermediate=32, features=2, block=4,
                                                                    anchors=4, conv_group_size=4, selector_rank=4,
                                                                    selector_top_k=4)),
    "dspark": ("specdec.drafters.dspark.train.DSparkRecipe", dict(layers=1, intermediate=32, features=2, block=4,
                                                                  anchors=4, markov_rank=4)),
    "gemma_mtp": ("specdec.drafters.gemma_mtp.train.GemmaMTPRecipe", dict(hidden=16, intermediate=32, anchors=4)),
    "mtp": ("specdec.drafters.mtp.train.PostHocMTPRecipe", dict(depth=2, loss="kl")),
}


@pytest.fixture(scope="module")
def tiny_target() -> Target:
    return Target(tiny_model("llama", vocab_size=V, init_scale=0.3, seed=0))


def sequences(n: int = 24, seed: int = 0) -> list[TokenSeq]:
    g = torch.Generator().manual_seed(seed)
    return [TokenSeq(torch.randint(0, V - 1, (int(t),), generator=g), 5) for t in torch.randint(12, 24, (n,), generator=g)]


def items(seqs: list[TokenSeq]) -> list[StoreItem]:
    return [StoreItem(s, 0, held_out_seq(s, EVERY)) for s in seqs]


def needs_of_all(target: Target) -> StoreNeeds:
    return recipe_needs_with_options(target, RECIPES.values())


def recipe_needs_with_options(target: Target, recipes) -> StoreNeeds:
    from specdec.training.recipe import load_recipe

    needs = StoreNeeds()
    for path, options in recipes:
        needs = needs.union(load_recipe(path, options).store_needs(target))
    return needs


def make_store(target: Target, folder: Path, seqs: list[TokenSeq], needs: StoreNeeds, dtype=torch.float32, **kw):
    return write_store(target, "tiny", items(seqs), folder, needs, [{"name": "random"}], EVERY, shard_sequences=5,
                       batch_tokens=64, dtype=dtype, **kw)


def test_a_store_round_trips_what_the_target_computes(tiny_target, tmp_path):
    seqs = sequences()
    needs = needs_of_all(tiny_target)
    assert needs.layers and needs.kv  # eagle3's and dflash's layers, the assistant's K/V layer
    store = make_store(tiny_target, tmp_path / "s", seqs, needs, dtype=torch.bfloat16)
    man = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert man["tokens"] == sum(s.tokens.numel() for s in seqs) == store.num_tokens
    assert man["target"]["hash"] == weights_hash(tiny_target) and man["layers"] == list(needs.layers)
    assert man["held_out"]["every"] == EVERY and man["sequences"] == len(seqs) and len(man["shards"]) == 5
    assert [s.tokens.tolist() for s in store.sequences] == [s.tokens.tolist() for s in seqs]
    assert store.held == [held_out_seq(s, EVERY) for s in seqs] and any(store.held) and not all(store.held)
    for i in (0, 7, 23):
        tokens = seqs[i].tokens.unsqueeze(0)
        hidden, final, kv = forward_with_kv(tiny_target, tokens, needs.layers, needs.kv)
        online_hidden, online_final = tiny_target.features(tokens, needs.layers)
        torch.testing.assert_close(final, online_final)  # the store's pass is the target's own forward
        row = StoredRow(tiny_target, store, i)
        got_hidden, got_final = row.features(tokens, needs.layers)
        assert got_final.dtype == tiny_target.dtype  # bf16-rounded rows, in the target's dtype
        assert torch.equal(got_final, got_final.bfloat16().to(tiny_target.dtype))
        torch.testing.assert_close(got_final.float(), final, rtol=1e-2, atol=1e-2)
        for j in needs.layers:
            torch.testing.assert_close(got_hidden[j].float(), online_hidden[j], rtol=1e-2, atol=1e-2)
        sources = {"full_attention": needs.kv[0]}
        (k, v), = target_kv(row, tokens, sources).values()
        torch.testing.assert_close(k.float(), kv[needs.kv[0]][0], rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(v.float(), kv[needs.kv[0]][1], rtol=1e-2, atol=1e-2)
    assert store_bytes_per_token(tiny_target, needs) > 0
    with pytest.raises(RuntimeError, match="does not run"):
        StoredRow(tiny_target, store, 0).decoder
    with pytest.raises(ValueError, match="its own sequence"):
        StoredRow(tiny_target, store, 0).features(seqs[1].tokens.unsqueeze(0), needs.layers)


def test_the_assistants_kv_from_one_forward_is_the_targets_cache(tiny_target):
    """K/V from the store's single forward equal what the target's own prefill caches."""
    tokens = sequences(2)[0].tokens.unsqueeze(0)
    layer = tiny_target.num_layers - 1
    _, _, kv = forward_with_kv(tiny_target, tokens, (), (layer,))
    session = tiny_target.new_session(1)
    with torch.no_grad():
        tiny_target.prefill(session, tokens.tolist())
    k, v = session.cache.layer(layer)
    torch.testing.assert_close(kv[layer][0], k.transpose(1, 2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv[layer][1], v.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_a_store_resumes_and_refuses_another_target_or_other_layers(tiny_target, tmp_path):
    seqs = sequences()
    needs = StoreNeeds(layers=(1, 2), kv=())
    make_store(tiny_target, tmp_path / "s", seqs, needs, max_tokens=40, command="fill 40")  # interrupted after a few shards
    first = FeatureStore(tmp_path / "s")
    assert 40 <= first.num_tokens < sum(s.tokens.numel() for s in seqs)
    shard0 = load_file(str(tmp_path / "s" / "shard-00000.safetensors"))
    whole_so_far = make_store(tiny_target, tmp_path / "s", seqs, needs, max_tokens=300, command="fill 300")
    (tmp_path / "s" / "shard-00002.safetensors").unlink()  # a process behind the others: shard 3 is on disk, 2 not
    assert (tmp_path / "s" / "shard-00003.safetensors").is_file() and len(whole_so_far.shards) >= 4
    assert [s["file"] for s in FeatureStore(tmp_path / "s").shards] == ["shard-00000.safetensors", "shard-00001.safetensors"]
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["command"] == "fill 300"
    whole = make_store(tiny_target, tmp_path / "s", seqs, needs, command="fill all")  # resumed: the missing shards are made
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["command"] == "fill all"  # the one that remakes it all
    make_store(tiny_target, tmp_path / "s", seqs, needs, max_tokens=40, command="fill 40")  # adds nothing
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["command"] == "fill all"
    assert whole.num_tokens == sum(s.tokens.numel() for s in seqs)
    again = load_file(str(tmp_path / "s" / "shard-00000.safetensors"))
    assert all(torch.equal(shard0[k], again[k]) for k in shard0)
    other = Target(tiny_model("llama", vocab_size=V, init_scale=0.3, seed=1))
    with pytest.raises(StoreMismatch, match="another target"):
        whole.check(other)
    with pytest.raises(StoreMismatch, match="target"):
        make_store(other, tmp_path / "s", seqs, needs)
    with pytest.raises(StoreMismatch, match="layers"):
        make_store(tiny_target, tmp_path / "s", seqs, StoreNeeds(layers=(0, 1)))
    with pytest.raises(StoreMismatch, match=r"hidden states \[0\]"):
        whole.check(tiny_target, StoreNeeds(layers=(0, 1)))
    with pytest.raises(StoreMismatch, match="held_out_every"):
        whole.check(tiny_target, needs, held_out_every=EVERY + 1)
    # a run whose recipe reads layers the store lacks fails before training
    cfg = TrainConfig(recipe=RECIPES["eagle3"][0], options=RECIPES["eagle3"][1], out=str(tmp_path / "o"),
                      work=str(tmp_path / "w"), data=DataConfig(store=str(tmp_path / "s"), held_out_every=EVERY),
                      optim=OptimConfig(steps=1, batch=2), progress=False)
    with pytest.raises(StoreMismatch, match=r"\[0\]"):
        train(cfg, target=tiny_target)


def test_a_store_refuses_a_resume_in_another_compute_dtype(tmp_path):
    """Weights exact in bf16 hash alike in both dtypes, so only the compute dtype tells the rows apart."""
    target = Target(tiny_model("llama", vocab_size=V, init_scale=0.3, seed=0).to(torch.bfloat16).float())
    seqs, needs = sequences(), StoreNeeds(layers=(1,), kv=())
    made = make_store(target, tmp_path / "s", seqs, needs, max_tokens=40)
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["compute_dtype"] == "float32"
    target.model.to(torch.bfloat16)
    with pytest.raises(StoreMismatch, match="compute_dtype='float32'.*'bfloat16'"):
        make_store(target, tmp_path / "s", seqs, needs)
    assert FeatureStore(tmp_path / "s").num_tokens == made.num_tokens


def _write_in_process(target: Target, folder: Path, seqs: list[TokenSeq], needs: StoreNeeds) -> None:
    """One of two processes: accelerate's debug launcher joins them in a gloo group but names no
    rank in the environment, where PartialState reads it; without it (or on a CPU target without
    ``cpu=True``) both would act as the only process, write every shard and race on the manifest."""
    import os

    import torch.distributed as dist
    from accelerate import PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ.update(RANK=str(dist.get_rank()), LOCAL_RANK=str(dist.get_rank()))
    state = PartialState(cpu=True)
    assert state.num_processes == 2 and state.process_index == dist.get_rank()
    make_store(target, folder, seqs, needs)


def test_two_processes_fill_the_store_one_process_does(tiny_target, tmp_path):
    seqs = sequences()
    needs = StoreNeeds(layers=(1,), kv=(1,))
    one = make_store(tiny_target, tmp_path / "one", seqs, needs)
    debug_launcher(_write_in_process, (tiny_target, tmp_path / "two", seqs, needs), num_processes=2)
    AcceleratorState._reset_state(reset_partial_state=True)
    two = FeatureStore(tmp_path / "two")
    assert two.manifest["shards"] == one.manifest["shards"] and two.num_tokens == one.num_tokens
    for shard in one.manifest["shards"]:
        a, b = (load_file(str(tmp_path / f / shard["file"])) for f in ("one", "two"))
        assert a.keys() == b.keys()
        for k in a:  # the same sequences in the same shard; features equal but for the last bits of
            # float sums (each process of the pair runs the target with its own thread count)
            if a[k].is_floating_point():
                torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_recipe_trained_from_the_store_matches_one_trained_online(name, tiny_target, tmp_path, monkeypatch):
    """Same tokens, same steps: the weights agree within float tolerance (the store here keeps fp32
    rows; a bf16 store changes them by its rounding), and the store run never runs the target."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    seqs = sequences()
    save_sequences(tmp_path / "data.safetensors", seqs)
    recipe, options = RECIPES[name]
    make_store(tiny_target, tmp_path / "store", seqs, recipe_needs_with_options(tiny_target, [(recipe, options)]))

    def config(tag: str, data: DataConfig) -> TrainConfig:
        return TrainConfig(recipe=recipe, options=options, out=str(tmp_path / tag), work=str(tmp_path / f"{tag}-w"),
                           data=data, optim=OptimConfig(steps=3, batch=4, lr=3e-3), log_every=1, progress=False)

    online = train(config("online", DataConfig(path=str(tmp_path / "data.safetensors"), held_out_every=EVERY)),
                   target=tiny_target)  # the target runs in the trainer, once per sequence
    calls = []
    for method in ("features", "prefill", "forward"):
        real = getattr(Target, method)
        monkeypatch.setattr(Target, method, lambda self, *a, _real=real, _m=method, **k: calls.append(_m) or _real(self, *a, **k))
    stored = train(config("stored", DataConfig(store=str(tmp_path / "store"), held_out_every=EVERY)), target=tiny_target)
    assert calls == [], f"the target ran while training from the store: {calls}"
    assert stored.record.tokens == online.record.tokens and stored.record.steps == 3
    a, b = online.model.state_dict(), stored.model.state_dict()
    assert a.keys() == b.keys()
    for k in a:  # atol: 1/30 of one Adam step (lr); a weight whose gradient is ~0 can move by float reordering
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-4, msg=lambda m, k=k: f"{name} {k}: {m}")
    assert stored.record.held_out["loss"] == pytest.approx(online.record.held_out["loss"], rel=1e-4)


def test_throughput_measures_both_compute_dtypes_interleaved(tiny_target):
    rows = throughput(tiny_target, items(sequences(4)), StoreNeeds(layers=(1,), kv=(1,)), rounds=2)
    assert [r["compute_dtype"] for r in rows] == ["float32", "bfloat16"] * 2
    assert all(r["tokens"] > 0 and r["seconds"] > 0 and 0 < r["forward_share"] <= 1 for r in rows)
    assert tiny_target.dtype == torch.float32  # put back


def test_a_run_in_parts_reads_new_store_sequences_and_every_held_out_one(tiny_target, tmp_path):
    seqs = sequences()
    make_store(tiny_target, tmp_path / "s", seqs, StoreNeeds(layers=(1,)))
    held = [i for i, s in enumerate(seqs) if held_out_seq(s, EVERY)]
    data = load_data(DataConfig(store=str(tmp_path / "s"), held_out_every=EVERY, skip=6, use=10), tiny_target)
    assert [s.store_index for s in data.train] == [i for i in range(6, 16) if i not in held]
    assert [s.store_index for s in data.held] == held
    with pytest.raises(ValueError, match="needs data.store"):
        DataConfig(skip=3)


def _curves():
    """The lab's learning-curves module (experiments/benchmarks/learning_curves.py)."""
    import importlib
    import sys

    experiments = str(Path(__file__).resolve().parents[1] / "experiments")
    if experiments not in sys.path:
        sys.path.insert(0, experiments)
    return importlib.import_module("benchmarks.learning_curves")


def test_curve_parts_are_consecutive_store_ranges_ending_at_each_point():
    parts = _curves().parts

    lengths, held = [10, 10, 10, 10, 10, 10, 10], [False, True, False, False, False, False, False]
    assert parts(lengths, held, [15, 30, 100]) == [(0, 3, 20), (3, 1, 10)]  # the held-out row counts no tokens
    assert parts(lengths, held, [60]) == [(0, 7, 60)] and parts(lengths, held, [61]) == []


def test_a_lever_runs_beside_the_plain_curve_with_its_overrides_last(tmp_path):
    collect, part_command, run_name = _curves().collect, _curves().part_command, _curves().run_name

    plain = part_command("eagle3", "st", "runs", 1, 10, 5, 3, 4, 16, 1)
    lever = part_command("eagle3", "st", "runs", 1, 10, 5, 3, 4, 16, 1, "ttt3", ("options.ttt_steps=3",))
    assert plain[-1] == "init=runs/eagle3/p0" and lever[-1] == "init=runs/eagle3@ttt3/p0"
    assert lever.index("options.ttt_steps=3") > lever.index("options.draft_vocab=4096")  # Hydra: the last one wins
    assert [a for a in lever if a.startswith("out=")] == ["out=runs/eagle3@ttt3/p1"]
    assert set(plain) ^ set(lever) == {"options.ttt_steps=3", "out=runs/eagle3/p1", "work=runs/eagle3/p1-work",
                                       "init=runs/eagle3/p0", "out=runs/eagle3@ttt3/p1",
                                       "work=runs/eagle3@ttt3/p1-work", "init=runs/eagle3@ttt3/p0"}
    with pytest.raises(ValueError, match="variant"):
        run_name("eagle3", "../x")
    for name in ("eagle3", "eagle3@ttt3", "mtp"):
        (tmp_path / name / "p0").mkdir(parents=True)
        (tmp_path / name / "p0" / "training.json").write_text(json.dumps(
            {"tokens": 100, "steps": 2, "wall_seconds": 1.0, "held_out": {}, "command": name}))
    assert list(collect(tmp_path, ("eagle3", "mtp"))) == ["eagle3", "eagle3@ttt3", "mtp"]


def test_a_report_keeps_the_earlier_records_curves_that_its_runs_do_not_hold(tmp_path):
    """A variant rerun beside curves recorded earlier: the page's record keeps those curves (each
    family's plain curve first, then its levers) and names where they came from; a curve the runs
    hold replaces its earlier points."""
    curves = _curves()
    decoded = {n: {"mean_accepted_length": 1.5, "acceptance_at": [0.4, 0.1]} for n in ("mtbench", "humaneval")}

    def point(tokens: int, command: str) -> dict:
        return {"tokens": tokens, "steps": 2, "wall_seconds": 1.0, "held_out": {}, "command": command,
                "decoded": decoded}

    page = tmp_path / "docs" / "curves.md"
    page.parent.mkdir()
    page.with_suffix(".json").write_text(json.dumps({
        "title": "t", "provenance": {"command": "old report", "git": "abc1234", "date": "2026-12-03", "machine": "m"},
        "curves": {"eagle3": [point(100, "old eagle3")], "mtp": [point(100, "old mtp")],
                   "eagle3@ttt3": [point(100, "old ttt3")]}}))
    runs = tmp_path / "runs"
    for name in ("eagle3@dense", "eagle3@ttt3"):
        (runs / name / "p0").mkdir(parents=True)
        (runs / name / "p0" / "training.json").write_text(json.dumps(
            {"tokens": 200, "steps": 3, "wall_seconds": 2.0, "held_out": {}, "command": f"new {name}"}))
        (runs / name / "p0" / "decoded.json").write_text(json.dumps(decoded))
    curves.report(str(runs), ["eagle3", "mtp"], str(page))
    record = json.loads(page.with_suffix(".json").read_text())
    assert list(record["curves"]) == ["eagle3", "eagle3@dense", "eagle3@ttt3", "mtp"]
    assert record["curves"]["eagle3@ttt3"][0]["command"] == "new eagle3@ttt3"  # the runs' points replace the earlier
    assert record["curves"]["eagle3"][0]["command"] == "old eagle3"
    assert record["provenance"]["earlier"].startswith("eagle3, mtp kept from the earlier record (git abc1234, 2026-12-03")
    assert "- earlier curves: eagle3, mtp kept" in page.read_text() and page.with_suffix(".png").is_file()


def test_the_curve_runner_reads_the_store_once_a_point_skips_finished_parts_and_resumes(tmp_path, monkeypatch):
    import specdec.api

    curves = _curves()

    looks, ran = [], []
    monkeypatch.setattr(curves, "store_rows", lambda store: looks.append(store) or (
        [10] * 7, [False, True, False, False, False, False, False], ["corpus"] * 7))

    def fake_train(cmd, check):  # the part's command writes its checkpoint's record
        ran.append(cmd)
        out = Path(next(a.split("=", 1)[1] for a in cmd if a.startswith("out=")))
        out.mkdir(parents=True)
        (out / "training.json").write_text("{}")

    monkeypatch.setattr(curves.subprocess, "run", fake_train)
    monkeypatch.setattr(specdec.api, "load_target", lambda name: "target")
    monkeypatch.setattr(curves, "held_out_prompts", lambda target, n: {})
    monkeypatch.setattr(curves, "decode", lambda target, family, out, prompts, k, n: {"family": family})
    runs = tmp_path / "runs"
    (runs / "mtp" / "p0").mkdir(parents=True)  # finished and decoded: skipped
    (runs / "mtp" / "p0" / "training.json").write_text("{}")
    (runs / "mtp" / "p0" / "decoded.json").write_text("{}")
    (runs / "eagle3" / "p1-work").mkdir(parents=True)  # interrupted: resumed from its state
    (runs / "eagle3" / "p1-work" / "state.safetensors").write_bytes(b"")
    curves.run(runs=str(runs), store="st", points=[15, 30], families=["mtp", "eagle3"], variant="", overrides=[],
               batch=4, eval_sequences=16, threads=torch.get_num_threads(), bf16=False, poll=0.0, prompts=8, k=4,
               max_new_tokens=48)
    assert looks == [Path("st"), Path("st")]  # one look at the store per point, not one per sequence
    assert [next(a for a in c if a.startswith("out=")) for c in ran] == [
        f"out={runs}/eagle3/p0", f"out={runs}/mtp/p1", f"out={runs}/eagle3/p1"]
    assert [c[-1] == "resume=true" for c in ran] == [False, False, True]
    assert "optim.steps=1" in ran[0]  # two training rows of three, batch 4
    decoded = json.loads((runs / "mtp" / "p1" / "decoded.json").read_text())
    assert decoded == {"family": "mtp", "point": 30, "part": 1, "part_tokens": 10, "steps": 1}
    assert json.loads((runs / "mtp" / "p0" / "decoded.json").read_text()) == {}


def test_tokens_to_the_aim_extrapolate_a_curves_log_linear_trend():
    _curves()  # experiments/ on the path: the renderer beside the lab's modules
    from report import tokens_to_reach

    slope, need = tokens_to_reach([(10_000, 1.1), (100_000, 1.2), (1_000_000, 1.3)], 2.5)
    assert slope == pytest.approx(0.1) and need == pytest.approx(1e6 * 10 ** 12, rel=1e-6)  # 1.2 more at 0.1/decade
    assert tokens_to_reach([(10_000, 1.2), (100_000, 1.1)], 2.5) == (pytest.approx(-0.1), None)  # falling: never
    assert tokens_to_reach([(10_000, 1.2)], 2.5) == (0.0, None)
    slope, need = tokens_to_reach([(30_000, 1.1), (100_000, 1.1001)], 2.5)  # barely rising: past any float, no error
    assert slope > 0 and need == float("inf")


def test_the_curves_page_names_the_store_compute_dtype(tmp_path):
    _store_dtype = _curves()._store_dtype

    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "manifest.json").write_text(json.dumps({"compute_dtype": "bfloat16"}))
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "manifest.json").write_text(json.dumps({}))  # before the key: the writer ran fp32
    assert "in bfloat16" in _store_dtype(f"python experiments/run.py --config-name train/smollm2_mtp data.store={tmp_path / 's'} data.skip=0")
    assert "in float32" in _store_dtype(f"python experiments/run.py --config-name train/smollm2_mtp data.store={tmp_path / 'old'}")
    assert "unknown" in _store_dtype("python experiments/run.py --config-name train/smollm2_mtp data.skip=0")


def test_the_curves_page_names_the_parts_trained_under_bf16_autocast():
    _training_precision = _curves()._training_precision

    fp32, bf16 = {"command": "python experiments/run.py --config-name train/smollm2_mtp optim.bf16=false"}, {"command": "python x optim.bf16=true"}
    assert _training_precision({"eagle3": [fp32, fp32], "mtp": [fp32]}) == "fp32 training and decoding"
    named = _training_precision({"eagle3": [fp32, fp32], "dflash": [fp32, bf16], "dspark": [bf16]})
    assert "dflash p1, dspark p0" in named and "eagle3" not in named and "fp32 decoding" in named


def test_a_curve_part_packages_as_a_checkpoint_its_chain_remakes(tmp_path, monkeypatch):
    """The packaged record adds up the parts and names every command that remakes the weights, the
    store's first; --record-only keeps the record alone; a part not yet trained is refused."""
    curves, package = _curves().curves, _curves().package
    from specdec.training.trainer import TrainingRecord

    store = tmp_path / "store"
    store.mkdir()
    (store / "manifest.json").write_text(json.dumps({"command": "python experiments/run.py --config-name lab/store out=st"}))
    runs = tmp_path / "runs"
    for i in range(3):
        part = runs / "mtp" / f"p{i}"
        part.mkdir(parents=True)
        init = f" init={runs}/mtp/p{i - 1}" if i else ""
        TrainingRecord(revision="abc", command=f"python experiments/run.py --config-name train/smollm2_mtp data.store={store} out={part}{init}",
                       config={}, steps=10 * (i + 1), tokens=1000 * (i + 1), wall_seconds=1.5,
                       held_out={"loss": 1.0 - i / 10}).write(part)
        (part / "model.safetensors").write_bytes(bytes([i]))
        (part / "config.json").write_text("{}")
    (runs / "mtp" / "p1" / "decoded.json").write_text(json.dumps(
        {"k": 4, "mtbench": {"mean_accepted_length": 1.25}, "humaneval": {"mean_accepted_length": 1.5}}))
    dest = package(runs, "mtp", 1, tmp_path / "ckpt", best_k={"k": 1, "measured": "cmd: 1.1x"})
    rec = TrainingRecord.read(dest)
    assert (rec.steps, rec.tokens, rec.wall_seconds) == (30, 3000, 3.0)
    assert rec.remake_first == ["python experiments/run.py --config-name lab/store out=st", f"python experiments/run.py --config-name train/smollm2_mtp "
                                f"data.store={store} out={runs}/mtp/p0"]
    assert f"init={runs}/mtp/p0" in rec.equivalent_command and f"out={runs}/mtp/p1" in rec.command  # as it ran
    assert rec.equivalent_command == rec.command.replace(f"out={runs}/mtp/p1", f"out={dest}")  # remade here
    assert [p["tokens"] for p in rec.parts] == [1000, 2000] and rec.best_k == {"k": 1, "measured": "cmd: 1.1x"}
    assert "1.250 (MT-bench)" in rec.note and (dest / "model.safetensors").read_bytes() == bytes([1])
    assert sorted(f.name for f in dest.iterdir()) == ["config.json", "model.safetensors", "training.json"]
    curves(action="package", runs=str(runs), family="mtp", part=2, dest=str(dest), record_only=True)
    assert [f.name for f in dest.iterdir()] == ["training.json"]  # the earlier weights are gone too
    assert "not committed" in TrainingRecord.read(dest).note and TrainingRecord.read(dest).best_k is None
    with pytest.raises(FileNotFoundError, match=r"no finished part"):
        package(runs, "mtp", 3, dest)
    for bad in ({"part": -1}, {"part": 1, "best_k": 2}, {"part": 1, "best_k": 0, "best_k_measured": "x"}):
        with pytest.raises(SystemExit):
            curves(action="package", runs=str(runs), family="mtp", dest=str(dest), **bad)
    # a recorded-only checkpoint says which folder its last command writes
    import specdec.models as models

    root = tmp_path / "root"
    package(runs, "mtp", 2, root / "smollm2-135m-mtp", weights=False)
    monkeypatch.setattr(models, "_checkpoint_root", lambda: root)
    command, out = models.uncommitted_checkpoints()["smollm2-135m-mtp"]
    assert command.startswith(f"{models.python_command()} experiments/run.py --config-name lab/store") and command.count(" && ") == 3
    assert out == str(root / "smollm2-135m-mtp")  # the chain's last part writes the recorded folder
