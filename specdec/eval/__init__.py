"""Evaluation: run configs, offline datasets, the benchmark runner and the demo."""
