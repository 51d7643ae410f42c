"""Accuracy measurements (perplexity) for comparing weight formats."""

from quickdraft.eval.perplexity import Perplexity, load_text, perplexity

__all__ = ["Perplexity", "load_text", "perplexity"]
