"""The training corpus: held-out rule, all ShareGPT turns, resumable shards, the target's own answers."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from specdec.data.config import DatasetConfig
from specdec.data.datasets import load_dataset
from specdec.data.corpus import TEMPERATURES, corpus_conversations, corpus_stats, generate_corpus, read_corpus
from specdec.data.datasets import HELD_OUT


def test_conversations_hold_out_the_benchmark_items_and_use_later_turns():
    convs = corpus_conversations(seed=0)
    firsts = {c[0]["content"] for c in convs}
    held_mt = load_dataset(DatasetConfig(name="mtbench", num_prompts=HELD_OUT["mtbench"], turns=2))
    held_he = load_dataset(DatasetConfig(name="humaneval", num_prompts=HELD_OUT["humaneval"]))
    held = {t for s in held_mt for t in s.turns} | {s.turns[0] for s in held_he}
    assert held and not held & firsts
    assert all(c[-1]["role"] == "user" for c in convs)
    assert any(len(c) >= 3 for c in convs), "later ShareGPT turns (with their context) are usable"
    assert convs == corpus_conversations(seed=0) and convs != corpus_conversations(seed=1)


@pytest.mark.slow
def test_shards_hold_the_targets_answers_and_resume(smollm2, tmp_path):
    from specdec.testing import assert_greedy_equivalent, greedy_reference

    folder = generate_corpus(smollm2, tmp_path / "c", num_prompts=5, shard_size=2, batch=2, max_new_tokens=6,
                             max_prompt_tokens=64, progress=False)
    seqs = list(read_corpus(folder))
    assert [s.prompt_id for s in seqs] == list(range(5))
    assert [round(s.temperature, 3) for s in seqs] == [round(TEMPERATURES[i % 3][0], 3) for i in range(5)]
    with safe_open(str(folder / "shard-00000.safetensors"), framework="pt") as f:
        assert f.get_tensor("tokens").dtype == torch.uint16
    for s in seqs:
        assert 0 < s.response_start < s.tokens.numel() <= s.response_start + 6
        if s.temperature == 0:  # greedy rows: exactly the target's own greedy continuation
            ref, logits = greedy_reference(smollm2.model, s.tokens[: s.response_start].tolist(), 6)
            answer = s.tokens[s.response_start:].tolist()
            assert_greedy_equivalent(answer, ref[: len(answer)], logits[: len(answer)])
    before = load_file(str(folder / "shard-00001.safetensors"))
    (folder / "shard-00001.safetensors").unlink()
    generate_corpus(smollm2, folder, num_prompts=5, shard_size=2, batch=2, max_new_tokens=6, max_prompt_tokens=64,
                    progress=False)
    after = load_file(str(folder / "shard-00001.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)  # seeded
    assert corpus_stats(folder)["sequences"] == 5
    # one shard of five prompts, two rows at a time: refilled rows or batches (the default), the same answers
    shards = [load_file(str(generate_corpus(smollm2, tmp_path / f"one-{c}", num_prompts=5, shard_size=5, batch=2,
                                            max_new_tokens=6, max_prompt_tokens=64, progress=False,
                                            continuous=c) / "shard-00000.safetensors")) for c in (True, False)]
    assert all(torch.equal(shards[0][k], shards[1][k]) for k in shards[0])


def test_the_committed_corpus_feeds_the_trainer_with_prompts_cut_and_the_same_held_out_items():
    from pathlib import Path

    from specdec.training.config import DataConfig
    from specdec.training.data import load_data

    folder = str(Path(__file__).resolve().parents[1] / "experiments" / "data" / "smollm2-135m")
    whole = load_data(DataConfig(source="corpus", path=folder, use=128, held_out_every=8), None)
    cut = load_data(DataConfig(source="corpus", path=folder, use=128, held_out_every=8, max_prompt=16), None)
    assert whole.held and len(whole.train) + len(whole.held) == 128
    assert [len(a.tokens) - a.response_start for a in whole.train] == [len(b.tokens) - b.response_start for b in cut.train]
    assert all(b.response_start <= 16 for b in cut.train + cut.held)
    assert all(torch.equal(a.tokens[a.response_start - b.response_start:], b.tokens)
               for a, b in zip(whole.held, cut.held))  # the held-out rule reads the whole prompt
    with pytest.raises(ValueError, match="data.path"):
        DataConfig(source="corpus")


def test_a_folder_made_with_other_settings_is_refused_before_any_work(tmp_path):
    from safetensors.torch import save_file

    from specdec.target import Target
    from specdec.testing.tiny import tiny_model

    target = Target(tiny_model("llama", vocab_size=32))
    meta = {"max_new_tokens": "256", "max_prompt_tokens": "512", "seed": "0", "vocab_size": "32"}  # an older shard
    save_file({"tokens": torch.zeros(1, dtype=torch.int32)}, str(tmp_path / "shard-00000.safetensors"), metadata=meta)
    with pytest.raises(ValueError, match="greedy"):
        generate_corpus(target, tmp_path, num_prompts=70, greedy=True, progress=False)
    with pytest.raises(ValueError, match="shard_size"):
        generate_corpus(target, tmp_path, num_prompts=70, shard_size=128, progress=False)
    with pytest.raises(ValueError, match="stop_repeat"):  # an older shard ran every answer to its limit
        generate_corpus(target, tmp_path, num_prompts=70, stop_repeat=32, progress=False)


@pytest.mark.slow
def test_the_generators_comparison_runs_both_settings_and_counts_their_page_faults(tmp_path):
    """Mode ``corpus`` with ``compare``: the committed corpus's settings, then these with freed memory
    kept (a child process: that setting is process-wide); nothing is written to ``out``."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "never"
    run = subprocess.run([sys.executable, "experiments/run.py", "--config-name", "lab/corpus", "compare=2", "batch=2",
                          "shard_size=2", "max_new_tokens=4", "greedy=true", "dtype=bfloat16", "stop_repeat=2", "continuous=true",
                          f"out={out}",
                          f"hydra.run.dir={tmp_path / 'hydra'}"], cwd=root, capture_output=True, text=True, check=True)
    text = run.stdout
    rows = json.loads(text[text.index("{"): text.rindex("}") + 1])
    before, after = rows.values()
    assert list(rows)[0].startswith("before (fp32") and "freed memory kept" in list(rows)[1]
    assert "stop at a repeated 2-gram" in list(rows)[1] and "repeated" not in list(rows)[0]
    assert "continuous batching" in list(rows)[1] and "continuous" not in list(rows)[0]
    for r in (before, after):
        assert 0 < r["response_tokens"] <= 2 * 4 and r["tokens_per_s"] > 0 and r["minor_page_faults"] >= 0
        assert 0 < r["unrepeated_tokens"] <= r["response_tokens"]
    assert not out.exists()


def _write_corpus(folder, answers: list[list[int]], prompt: list[int]) -> None:
    from safetensors.torch import save_file

    folder.mkdir()
    seqs = [torch.tensor(prompt + a) for a in answers]
    save_file({"tokens": torch.cat(seqs).to(torch.uint16),
               "offsets": torch.tensor([0] + [len(t) for t in seqs]).cumsum(0),
               "response_start": torch.full((len(seqs),), len(prompt), dtype=torch.int32),
               "prompt_id": torch.arange(len(seqs), dtype=torch.int32),
               "temperature": torch.zeros(len(seqs)), "top_p": torch.ones(len(seqs))},
              str(folder / "shard-00000.safetensors"))


def test_repeated_ngrams_mark_the_tokens_a_loop_wrote():
    from specdec.data.corpus import repeated_ngrams

    loop = [1, 2, 3]
    assert repeated_ngrams([9, 8] + loop * 3, n=3) == [False] * 7 + [True] * 4  # from the second pass of the loop on
    assert not any(repeated_ngrams(list(range(20)), n=2))
    assert repeated_ngrams([5, 5, 5], n=1) == [False, True, True]


def test_corpus_repetition_counts_repeats_by_answer_position(tmp_path):
    from specdec.data.corpus import corpus_repetition

    fresh = list(range(100, 110))  # ten distinct tokens, then a two-token loop
    _write_corpus(tmp_path / "c", [fresh + [7, 8] * 5, list(range(200, 220))], prompt=[1, 2, 3])
    bins = corpus_repetition(tmp_path / "c", n=2, edges=(0, 10, 20))
    assert [b["tokens"] for b in bins] == [20, 20]
    assert bins[0]["repeated"] == 0.0
    assert bins[1]["repeated"] == 0.35  # (109, 7), (7, 8), (8, 7) are new, then 13..19 repeat: 7 of 20
    assert corpus_repetition(tmp_path / "c", n=2, edges=(0, 10, 20), sequences=1)[0]["tokens"] == 10
    with pytest.raises(ValueError, match="edges"):
        corpus_repetition(tmp_path / "c", edges=(10, 0))


def _experiments_module(name: str, monkeypatch):
    """A module of ``experiments/`` (the runner's modes), importable for this test only."""
    import importlib
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "experiments"))
    return importlib.import_module(name)


def test_mode_corpus_report_reads_a_folder_and_loads_no_target(tmp_path, monkeypatch):
    mode = _experiments_module("generate_corpus", monkeypatch)
    monkeypatch.setattr(mode.specdec, "load_target", lambda *a, **k: pytest.fail("report loads no target"))
    _write_corpus(tmp_path / "c", [[4, 5, 6] * 6], prompt=[1])
    stats = mode.grow(out=str(tmp_path / "c"), report=True)
    assert stats["sequences"] == 1 and stats["response_tokens"] == 18
    # 8-grams end at 7..17; from 10 on each is the one three positions earlier: 8 of 18 tokens
    assert stats["repetition_8gram"][0] == {"from": 0, "to": 96, "tokens": 18, "repeated": round(8 / 18, 4)}
    with pytest.raises(SystemExit, match="no corpus shards"):
        mode.grow(out=str(tmp_path / "empty"), report=True)


def test_a_data_jobs_device_is_checked_before_any_work(monkeypatch):
    """``device`` of the corpus generator and the store's fill: the CPU as None (the loaders'
    default), a GPU by name or ``auto``; a device that is not one, or not here, is refused by name."""
    from specdec.data.config import data_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert data_device(None) is None and data_device("cpu") is None and data_device("auto") is None
    with pytest.raises(ValueError, match="no CUDA or ROCm GPU"):
        data_device("cuda")
    with pytest.raises(ValueError, match="'tpu9' is not a torch device"):
        data_device("tpu9")
    with pytest.raises(TypeError, match="device must be a string"):
        data_device(0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert data_device("cuda:0") == "cuda:0" and data_device("cuda") == "cuda"
    with pytest.raises(ValueError, match="has 1 GPU"):
        data_device("cuda:3")


def test_mode_corpus_puts_the_target_on_its_device_and_refuses_a_bad_one_before_loading(tmp_path, monkeypatch):
    mode = _experiments_module("generate_corpus", monkeypatch)
    placed = []

    def load(model, **kw):
        placed.append(kw["device_map"])
        raise RuntimeError("loaded")

    monkeypatch.setattr(mode.specdec, "load_target", load)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # grow sets the process's threads
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA or ROCm GPU"):
        mode.grow(out=str(tmp_path / "c"), device="cuda")
    assert placed == []
    with pytest.raises(RuntimeError, match="loaded"):
        mode.grow(out=str(tmp_path / "c"), device="cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(RuntimeError, match="loaded"):
        mode.grow(out=str(tmp_path / "c"), device="cuda:1")
    assert placed == [None, "cuda:1"] and not (tmp_path / "c").exists()


def test_mode_store_puts_the_target_on_its_device_and_refuses_a_bad_one_before_loading(tmp_path, monkeypatch):
    mode = _experiments_module("benchmarks.store_fill", monkeypatch)
    placed = []

    def build(cfg):
        placed.append(cfg.device_map)
        raise RuntimeError("loaded")

    monkeypatch.setattr(mode, "build_target", build)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="'gpu' is not a torch device"):
        mode.fill(out=str(tmp_path / "s"), device="gpu")
    assert placed == []
    with pytest.raises(RuntimeError, match="loaded"):
        mode.fill(out=str(tmp_path / "s"), device="auto")  # no GPU here: the CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeError, match="loaded"):
        mode.fill(out=str(tmp_path / "s"), device="cuda")
    assert placed == [None, "cuda"] and not (tmp_path / "s").exists()
