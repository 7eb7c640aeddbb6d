"""Quiet success: a lossy verifier warns once per process, not once per call, and the expected load
report of the tiny DeepSeek-V3 (its MTP modules, which transformers' model does not build) becomes
one line that says why; any other load report passes unchanged."""

from __future__ import annotations

import logging
import warnings

import pytest

import specdec
from specdec.loop import LossyVerifierWarning
from specdec.models import _MTPReportFilter, load_model
from specdec.sampling import SamplingParams


def test_a_lossy_verifier_warns_once_per_process(target):
    sampled = SamplingParams(temperature=1.0, seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # no filter of Python's own hides a repeat: the library says it once
        for _ in range(5):
            out = specdec.generate(target, [[1, 2, 3]], "ngram", verifier="typical", max_new_tokens=3, sampling=sampled)
            assert out.summary.lossless is False and "LOSSY" in str(out.summary)  # every summary still says so
    lossy = [w for w in caught if issubclass(w.category, LossyVerifierWarning)]
    assert len(lossy) == 1 and "once per process" in str(lossy[0].message)


def test_the_tiny_deepseek_v3_load_report_is_one_line_that_says_why(caplog, capfd):
    with caplog.at_level(logging.WARNING):
        model, _ = load_model("tiny-deepseek-v3-mtp")
    texts = [r.getMessage() for r in caplog.records]
    assert not any("UNEXPECTED" in t and "LOAD REPORT" in t for t in texts), texts
    why = [t for t in texts if "MTP module" in t]
    assert len(why) == 1 and "layers 4-5" in why[0] and "mtp drafter reads them" in why[0]
    assert "UNEXPECTED |" not in capfd.readouterr().err
    assert model.config.num_nextn_predict_layers == 2


REPORT = ("DeepseekV3ForCausalLM LOAD REPORT from: x\nKey | Status |  | \n----+----\n"
          "model.layers.{4, 5}.enorm.weight | UNEXPECTED |  | \n{extra}\nNotes:\n- UNEXPECTED: can be ignored")


@pytest.mark.parametrize("extra, dropped", [
    ("", True),
    ("model.layers.6.enorm.weight | UNEXPECTED |  | ", False),    # a layer past the MTP modules
    ("model.layers.{3, 4}.mlp.gate.weight | UNEXPECTED |  | ", False),  # a decoder layer
    ("model.layers.4.enorm.weight | MISSING |  | ", False),        # another status
    ("lm_head.weight | MISMATCH |  | ", False),
])
def test_only_a_report_of_mtp_weights_alone_is_filtered(extra, dropped):
    record = logging.LogRecord("transformers.modeling_utils", logging.WARNING, __file__, 1,
                               REPORT.replace("{extra}", extra), None, None)
    assert _MTPReportFilter("tiny", first=4, n=2).filter(record) is not dropped
