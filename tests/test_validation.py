"""User input is checked in one place: types included, before any work starts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import specdec
from specdec.loop import Request, run
from specdec.sampling import SamplingParams
from specdec.verifiers import RejectionVerifier


@pytest.mark.parametrize("kwargs, error, match", [
    ({"temperature": True}, TypeError, "temperature must be a number"),
    ({"temperature": float("nan")}, ValueError, "temperature must be finite"),
    ({"temperature": -0.1}, ValueError, "temperature must be >= 0"),
    ({"top_k": float("nan")}, TypeError, "top_k .* must be an integer"),
    ({"top_k": 2.7}, TypeError, "top_k .* must be an integer"),
    ({"top_k": -1}, ValueError, "top_k .* must be >= 0"),
    ({"top_p": 0.0}, ValueError, "top_p must be > 0"),
    ({"top_p": "0.9"}, TypeError, "top_p must be a number"),
    ({"seed": 2**70}, ValueError, "seed must be <="),
    ({"seed": 1.0}, TypeError, "seed must be an integer"),
])
def test_bad_sampling_parameters_name_themselves(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


def test_numpy_and_tensor_scalars_are_accepted_as_numbers():
    p = SamplingParams(temperature=np.float32(0.5), top_k=torch.tensor(3), top_p=np.float64(0.9), seed=np.int64(7))
    assert (type(p.temperature), type(p.top_k), type(p.top_p), type(p.seed)) == (float, int, float, int)
    assert (p.top_k, p.seed) == (3, 7)


@pytest.mark.parametrize("prompts, match", [
    ([[1.5, 2.0]], "must be an integer"),
    (torch.tensor([[1.5, 2.0]]), "integer token ids"),
    (np.array([1.0, 2.0]), "integer token ids"),
    ([[1, 2], "text"], "mixes text and token ids"),
    ([], "non-empty"),
    (7, "must be a string, token ids"),
])
def test_bad_prompts_are_refused_before_work(target, prompts, match):
    with pytest.raises(TypeError, match=match):
        specdec.generate(target, prompts, drafter="ngram", max_new_tokens=2)


def test_tensor_and_numpy_prompts_give_the_list_result(target):
    ref = specdec.generate(target, [[1, 2, 3], [4, 5]], drafter="ngram", max_new_tokens=4).tokens
    assert specdec.generate(target, torch.tensor([1, 2, 3]), drafter="ngram", max_new_tokens=4).tokens == ref[:1]
    assert specdec.generate(target, np.array([[1, 2, 3]]), drafter="ngram", max_new_tokens=4).tokens == ref[:1]
    assert specdec.generate(target, [torch.tensor([1, 2, 3]), np.array([4, 5])], drafter="ngram",
                            max_new_tokens=4).tokens == ref


def test_a_list_of_numpy_integers_is_one_prompt_as_a_list_of_ints_is(target):
    ref = specdec.generate(target, [1, 2, 3], drafter="ngram", max_new_tokens=4).tokens
    assert len(ref) == 1
    for ids in ([np.int64(1), np.int32(2), np.uint8(3)], list(np.array([1, 2, 3])),
                [torch.tensor(1), torch.tensor(2), torch.tensor(3)]):
        assert specdec.generate(target, ids, drafter="ngram", max_new_tokens=4).tokens == ref


@pytest.mark.parametrize("k, max_new_tokens, error, match", [
    (1.5, 4, TypeError, "k .* must be an integer"),
    (True, 4, TypeError, "k .* must be an integer"),
    (2, 2.5, TypeError, "max_new_tokens must be an integer"),
    (2, 0, ValueError, "max_new_tokens must be >= 1"),
])
def test_bad_k_and_lengths_are_refused(target, k, max_new_tokens, error, match):
    d = specdec.make_drafter("ngram", target)
    with pytest.raises(error, match=match):
        run(target, d, RejectionVerifier(), [Request([1, 2, 3], max_new_tokens)], k=k)


def test_requests_must_be_requests(target):
    with pytest.raises(TypeError, match="must be a specdec.Request"):
        run(target, None, RejectionVerifier(), [[1, 2, 3]])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="sampling must be a SamplingParams"):
        run(target, None, RejectionVerifier(), [Request([1, 2], 2, {"temperature": 1.0})])  # type: ignore[arg-type]


def test_a_drafted_token_with_zero_or_nan_q_is_refused():
    from specdec.types import DraftProposal

    q = torch.full((1, 2, 4), 0.25)
    q[0, 1] = torch.tensor([0.5, 0.5, 0.0, 0.0])
    with pytest.raises(ValueError, match="node 1: drafted token 3 has q = 0"):
        DraftProposal.chain(torch.tensor([[1, 3]]), q).validate(1, 4)
    q[0, 1, 3] = float("nan")
    with pytest.raises(ValueError, match="node 1: drafted token 3 has q = nan"):
        DraftProposal.chain(torch.tensor([[1, 3]]), q).validate(1, 4)
    # padding nodes past num_valid are not verified, so their q is not checked
    DraftProposal.chain(torch.tensor([[1, 3]]), q, num_valid=torch.tensor([1])).validate(1, 4)


def test_random_drafter_exhausting_top_p_falls_back_to_one_hot(target):
    """Siblings drawn without replacement at T 1.3, top-p 0.8 exhaust the warped distribution: the
    drafter falls back to a one-hot q."""
    from specdec.testing import RandomDrafter
    from specdec.sampling import RowSampling

    d = RandomDrafter.create(target, siblings="without_replacement", branching=[3, 1])
    rows = RowSampling([SamplingParams(temperature=1.3, top_p=0.8, seed=s) for s in range(8)])
    state = d.start(None, rows)  # type: ignore[arg-type]
    for _ in range(20):
        p = d.propose(state, 2, rows)
        p.validate(8, target.vocab_size)  # every drafted token has q > 0
        assert torch.allclose(p.q.sum(-1), torch.ones(8, p.n))


def test_summary_is_typed_with_units_saves_as_json_and_labels_lossy_runs(target, tmp_path):
    import json
    import warnings

    from specdec.loop import LossyVerifierWarning
    from specdec.metrics import GenerationSummary

    out = specdec.generate(target, [[1, 2, 3, 1, 2]], drafter="ngram", k=3, max_new_tokens=6)
    s = out.summary
    assert isinstance(s, GenerationSummary) and s.lossless and s.drafter == "ngram" and s.verifier == "rejection"
    assert s["mean_accepted_length"] == s.mean_accepted_length >= 1.0 and s.new_tokens == len(out.tokens[0])
    assert "tokens/s" in str(s) and "LOSSY" not in str(s)
    out.save_json(tmp_path / "r.json")
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["summary"] == json.loads(s.to_json()) and saved["tokens"] == out.tokens
    with pytest.warns(LossyVerifierWarning, match="typical"):
        lossy = specdec.generate(target, [[1, 2, 3]], drafter="ngram", verifier="typical", max_new_tokens=4,
                                 sampling=SamplingParams(temperature=1.0, seed=0))
    assert lossy.summary.lossless is False and "LOSSY" in str(lossy.summary)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LossyVerifierWarning)
        specdec.generate(target, [[1, 2, 3]], drafter="ngram", max_new_tokens=4)  # lossless: no warning


def test_checkpoints_by_name_and_clear_errors_for_missing_ones(target, tmp_path):
    from specdec.models import committed_checkpoints, load_model, resolve_checkpoint

    committed = committed_checkpoints()
    assert {"smollm2-135m-eagle3", "tiny-deepseek-v3-mtp"} <= set(committed)
    assert resolve_checkpoint("smollm2-135m-eagle3") == committed["smollm2-135m-eagle3"]
    assert (resolve_checkpoint("smollm2-135m-eagle3") / "model.safetensors").is_file()
    with pytest.raises(FileNotFoundError, match="committed checkpoints: .*smollm2-135m-eagle3"):
        specdec.make_drafter("eagle3", target, checkpoint="org/some-eagle3")
    from specdec.models import uncommitted_checkpoints

    recorded = uncommitted_checkpoints()  # kept as training.json only: the size budget
    assert recorded and not set(recorded) & set(committed)
    name, (command, out) = next(iter(recorded.items()))
    assert "experiments/run.py --config-name train/" in command and out.endswith(name)
    with pytest.raises(FileNotFoundError, match=f"is not committed .* make it, from the repository root, with: .*train/.*{out}"):
        resolve_checkpoint(name)
    with pytest.raises(FileNotFoundError, match="is not committed"):  # by its folder's path, as the configs name it
        resolve_checkpoint(committed["smollm2-135m-eagle3"].parent / name)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ValueError, match="only pickled weights"):
        load_model(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="not a local folder"):
        load_model(str(tmp_path / "missing"))
