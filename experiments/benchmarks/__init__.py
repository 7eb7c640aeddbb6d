"""The lab's jobs that are not a decoding question, one module each, every one a mode of the one runner:
``python experiments/run.py --config-name lab/<mode> key=value ...`` (``experiments/conf/lab/<mode>.yaml``
lists each mode's parameters; ``experiments/run.py``'s ``LAB_MODES`` maps a mode to its function).

- ``acceptance``: a preset's learned drafters' acceptance alone on held-out prompts, no clock.
- ``step_anatomy``: where one target forward spends its time; each fp32 product per row count.
- ``peak_memory``: peak RSS of one long-context generation, a process per method (``generate()`` beside them).
- ``kernels``: the rejection-sampler kernel against its torch reference.
- ``compile_kernels``: every Triton kernel compiled for real GPU targets, no GPU needed.
- ``capture_cpu``: each capture mode of the target's step on this CPU (what ``capture="auto"`` picks), beside ``generate()``.
- ``ar_ratio``: the library's autoregressive tokens/s over ``generate()``, best of interleaved repetitions.
- ``gpu``: the GPU kit (``make gpu-bench``, docs/gpu.md).
- ``learning_curves`` (mode ``curves``): every learned family trained from the feature store at equal tokens,
  each point decoded, and the curves page.
- ``store_fill`` (mode ``store``): fill (or resume) a target feature store.
- ``token_map``: the target's tokens ranked by how often it writes them in the corpus.
- ``eagle3_chain_estimate``: an EAGLE-3 head's training-time estimate against decoding.
- ``eagle3_serving``: the vLLM / SGLang settings that serve an EAGLE-3 checkpoint.
- ``hybrid_choice``: which part the hybrid drafter proposes from, per rule, and when its learned part sits out.
- ``preset_steps``: the target steps each preset decodes, the basis of its run time, no clock.
- ``train_rates``: every recipe trained by another checkout and by this one at equal tokens, back to back.
- ``train_flops``: FLOPs per trained position of every recipe against a measured rate (a training roofline).

Every timing goes through :mod:`specdec.timing`. The decoding questions themselves (which drafter,
which k, which context) are presets of the one runner, ``experiments/run.py --config-name
<question>`` (docs/experiments.md); their tables are rendered by ``experiments/report.py``.
"""
