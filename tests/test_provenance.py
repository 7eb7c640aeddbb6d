"""One provenance record (specdec.provenance): the CPU read once, the same fields for every job."""

from __future__ import annotations

import torch

from specdec import provenance

# /proc/cpuinfo cut down: 4 logical CPUs on 2 cores of one socket (hyper-threads)
CPUINFO = "\n\n".join(
    f"processor\t: {i}\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nphysical id\t: 0\ncore id\t\t: {i // 2}\n"
    "flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile amx_bf16 amx_int8" for i in range(4)) + "\n"


def test_the_cpu_is_read_from_cpuinfo_model_extensions_and_cores():
    c = provenance._parse_cpuinfo(CPUINFO)
    assert c.model == "Intel(R) Xeon(R) Platinum 8480+"
    assert c.isa == ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16") and c.physical_cores == 2
    arm = provenance._parse_cpuinfo("processor\t: 0\nFeatures\t: fp asimd\n")  # no model name, no core id
    assert arm.model and arm.isa == () and arm.physical_cores is None


def test_the_cpu_is_read_once_per_process(monkeypatch):
    provenance.cpu.cache_clear()
    reads = []
    real = provenance._parse_cpuinfo
    monkeypatch.setattr(provenance, "_parse_cpuinfo", lambda text: reads.append(text) or real(text))
    assert provenance.cpu() is provenance.cpu() and provenance.cpu_model() == provenance.cpu().model
    assert len(reads) == 1


def test_a_record_names_command_commit_machine_versions_and_date():
    rec = provenance.record("bfloat16", argv=["experiments/run.py", "+preset=x"])
    assert rec["command"] == "python experiments/run.py +preset=x"
    assert set(rec) >= {"git_sha", "git_dirty", "python", "torch", "transformers", "machine", "date"}
    assert rec["torch"] == torch.__version__ and rec["date"].endswith("UTC")
    m = rec["machine"]
    assert m["cpu"] == provenance.cpu_model() and m["dtype"] == "bfloat16" and m["threads"] == torch.get_num_threads()
    assert set(m["cpu_isa"]) <= set(provenance.ISA)
    assert (m["gpu"] is None) == (not torch.cuda.is_available())
    assert provenance.record(on_gpu=False)["machine"]["gpu"] is None
