"""EAGLE-3: the drafter, its head, trees, checkpoint formats and the training-time test."""
