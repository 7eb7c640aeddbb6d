"""retain_freed_memory: freed large CPU tensors are reused without new page faults (in a child
process: the setting is process-wide and one-way)."""

import json
import platform
import subprocess
import sys

import pytest

CHILD = """
import json, torch
from specdec.host_memory import minor_faults, retain_freed_memory
def churn():  # a 64 MiB activation made and freed, as every layer of a batched forward does
    start = minor_faults()
    for _ in range(32):
        torch.empty(16 << 20, dtype=torch.float32).fill_(1.0)
    return minor_faults() - start
churn()
before = churn()
applied = retain_freed_memory()
churn()
print(json.dumps({"before": before, "after": churn(), "applied": applied}))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's malloc's (mallopt)")
def test_freed_activations_are_reused_without_page_faults():
    out = json.loads(subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True
                                    ).stdout.strip().splitlines()[-1])
    assert out["applied"] is True
    pages = 32 * (64 << 20) // 4096
    assert out["before"] > pages // 2, out  # glibc maps each block afresh: every page faults again
    assert out["after"] < out["before"] // 20, out
