"""The Gemma-4-style assistant: Q-only layers that read the target's KV cache."""
