"""The committed drafter checkpoints, installed as ``specdec.checkpoints``.

Each folder is one checkpoint in its family's real format; ``specdec.models.resolve_checkpoint``
finds it by its folder name (``checkpoint="smollm2-135m-eagle3"``) from any working directory.
"""
