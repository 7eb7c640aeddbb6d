"""Run by the side environment's python (the real ``speculators`` package, ``make interop``), never
imported by specdec's tests: loads a checkpoint with speculators' own classes, dumps what it holds,
and saves it again with speculators' own ``save_pretrained``.

    python speculators_side.py <checkpoint folder> <out folder>

writes ``<out>/loaded.safetensors`` (the model's state dict as speculators loaded it),
``<out>/config.json`` (speculators' parsed config, ``to_dict()``) and ``<out>/saved/`` (its save).
"""

import json
import sys
from importlib.metadata import version

import torch
from safetensors.torch import save_file

from speculators import SpeculatorModel

src, out = sys.argv[1], sys.argv[2]
model = SpeculatorModel.from_pretrained(src)
state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if v is not None}
save_file(state, f"{out}/loaded.safetensors")
config = model.config.to_dict()
config["_class"] = type(model).__name__
config["_speculators_version"] = version("speculators")
config["_transformers_version"] = version("transformers")
config["_torch_version"] = torch.__version__
with open(f"{out}/config.json", "w") as f:
    json.dump(config, f, indent=1, default=str)
model.save_pretrained(f"{out}/saved")
