"""Hybrid drafting: a model-free and a learned part, chosen per row and step."""
