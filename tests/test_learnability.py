"""Every training recipe can learn what it should: a planted target, a short training, real decoding.

The target is built so that its greedy continuation is a known function of the context: a fixed
permutation of the last token (``perm[t]``), read through its embedding and head. Its layers add
nothing to the residual stream (attention and MLP outputs are zero), so every hidden state is the
current token's one-hot embedding, and its head maps that embedding to ``perm[t]`` with a large
margin. A recipe that aligns features and labels right learns ``perm`` (and its powers, for deeper
drafts) in seconds; decoded through the real loop, its drafts are then accepted at every depth it
trains. The same recipe with every target feature shifted by one position (a planted off-by-one
between features and labels, the bug that trains, decodes losslessly and stays flat) learns the
identity instead and is rejected.

Each recipe is driven only through its public training entry: :func:`specdec.training.trainer.train`
with a :class:`~specdec.training.config.TrainConfig` naming the recipe's dotted path and its
``options``, on a data set file (``data.path``); the planted shift wraps the recipe class's
``featurize`` (what the trainer asks for the target features and the labels derived from them).
The trained checkpoint is loaded by the family's registered drafter (``create(target,
checkpoint=out)``) and decoded with the greedy verifier.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdec.drafters import DRAFTERS
from specdec.data.sequences import TokenSeq, save_sequences
from specdec.loop import Request, run
from specdec.metrics import summarize
from specdec.target import Target
from specdec.testing.tiny import tiny_model
from specdec.training.config import DataConfig, OptimConfig, TrainConfig
from specdec.training.recipe import load_recipe
from specdec.training.trainer import train
from specdec.verifiers import GreedyVerifier

# the slow tier: twelve short trainings (3-27 s each on one thread), not unit tests
pytestmark = pytest.mark.slow

V, D = 24, 32  # vocabulary (the last id is the block drafters' mask token, never in a chain), hidden size
THRESHOLD = 0.95
NEW = 32  # tokens decoded per held-out prompt
# recipe name -> (registry name, recipe path, options, draft depth it trains, optimiser)
RECIPES = {
    "eagle3": ("eagle3", "specdec.drafters.eagle3.train.Eagle3Recipe",
               dict(layer_ids=[0, 1, 2], draft_vocab=V, ttt_steps=3, anchors=16, eval_anchors=16), 3),
    "mtp": ("mtp", "specdec.drafters.mtp.train.PostHocMTPRecipe", dict(depth=2, loss="kl", lam=1.0), 2),
    "gemma_mtp": ("gemma_mtp", "specdec.drafters.gemma_mtp.train.GemmaMTPRecipe",
                  dict(hidden=32, intermediate=64, unroll=3, anchors=16), 3),
    "dflash": ("dflash", "specdec.drafters.dflash.train.DFlashRecipe",
               dict(layers=1, intermediate=128, features=2, block=4, anchors=32, eval_anchors=16, loss="kl"), 3),
    "dflash2": ("dflash2", "specdec.drafters.dflash2.train.DFlash2Recipe",
                dict(layers=1, intermediate=128, features=2, block=4, anchors=16, eval_anchors=16, loss="kl",
                     selector_rank=8, selector_top_k=4), 3),
    "dspark": ("dspark", "specdec.drafters.dspark.train.DSparkRecipe",
               dict(layers=1, intermediate=128, features=2, block=4, anchors=32, eval_anchors=16, markov_rank=8), 4),
}
STEPS, LR = 500, 1e-2


def permutation_target(seed: int = 0, margin: float = 3.0) -> tuple[Target, list[int]]:
    """A 4-layer Llama whose greedy next token is ``perm[last token]``: one-hot embeddings, layers
    whose attention and MLP write nothing, a head with ``perm[t]``'s row on ``t``'s coordinate."""
    model = tiny_model("llama", vocab_size=V, hidden_size=D, num_hidden_layers=4, seed=seed)
    g = torch.Generator().manual_seed(seed)
    chain = torch.randperm(V - 1, generator=g).tolist()  # one cycle through every id but the mask token
    perm = [0] * V
    for a, b in zip(chain, chain[1:] + chain[:1]):
        perm[a] = b
    perm[V - 1] = chain[0]
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.zero_()
        emb[:, :V] = torch.eye(V)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        head = model.get_output_embeddings().weight
        head.zero_()
        for t in range(V):
            head[perm[t], t] = margin  # logit margin margin·sqrt(D) ≈ 17 after the final norm
    return Target(model), perm


def chain_data(path: Path, perm: list[int], n: int = 64, length: int = 48, seed: int = 1) -> Path:
    """``n`` sequences: a 5-token random prompt, then the target's greedy chain from its last token."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(n):
        toks = torch.randint(0, V - 1, (5,), generator=g).tolist()
        while len(toks) < length:
            toks.append(perm[toks[-1]])
        seqs.append(TokenSeq(torch.tensor(toks), 5))
    save_sequences(path, seqs)
    return path


def shift_features(monkeypatch, recipe_path: str) -> None:
    """Plant an off-by-one: position ``i`` gets the target features (and the labels derived from
    them) of position ``i - 1``."""
    cls = type(load_recipe(recipe_path, RECIPES_OPTIONS[recipe_path]))
    original = cls.featurize

    def shifted(self, target, tokens):
        out = original(self, target, tokens)
        return {k: torch.cat([v[:, :1], v[:, :-1]], 1) if v.dim() >= 2 and v.shape[1] == tokens.shape[1] else v
                for k, v in out.items()}

    monkeypatch.setattr(cls, "featurize", shifted)


RECIPES_OPTIONS = {path: options for _, path, options, _ in RECIPES.values()}


def learned_acceptance(name: str, tmp_path: Path, target: Target, perm: list[int]) -> list[float]:
    """Train ``name`` on the target's chains, decode held-out prompts with its checkpoint: acceptance by depth."""
    registry, recipe, options, depth = RECIPES[name]
    data = DataConfig(path=str(chain_data(tmp_path / "data.safetensors", perm)), held_out_every=8,
                      cache_features=False)
    cfg = TrainConfig(recipe=recipe, options=options, data=data, out=str(tmp_path / "out"),
                      work=str(tmp_path / "work"), optim=OptimConfig(steps=STEPS, batch=4, lr=LR, warmup=0.05),
                      progress=False, log_every=STEPS)
    train(cfg, command="tests/test_learnability.py", target=target)
    drafter = DRAFTERS[registry].create(target, checkpoint=cfg.out)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, V - 1, (5,), generator=g).tolist() for _ in range(8)]
    res = run(target, drafter, GreedyVerifier(), [Request(p, NEW) for p in prompts], k=depth, eos_token_ids=set())
    for p, r in zip(prompts, res.requests):  # the target is what it was built to be
        want = [perm[p[-1]]]
        while len(want) < NEW:
            want.append(perm[want[-1]])
        assert r.tokens == want
    return summarize([r.metrics for r in res.requests])["acceptance_at"]


@pytest.fixture(scope="module")
def planted() -> tuple[Target, list[int]]:
    return permutation_target()


@pytest.fixture()
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_learns_the_planted_target_at_every_depth_it_trains(name, planted, tmp_path, cache):
    acc = learned_acceptance(name, tmp_path, *planted)
    assert len(acc) == RECIPES[name][3] and min(acc) >= THRESHOLD, acc


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_feature_label_shift_by_one_position_fails_to_learn(name, planted, tmp_path, cache, monkeypatch):
    shift_features(monkeypatch, RECIPES[name][1])
    acc = learned_acceptance(name, tmp_path, *planted)
    assert min(acc) < THRESHOLD, acc
