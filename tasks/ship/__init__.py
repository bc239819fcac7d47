"""Stages 6-7: compress (quantize, prune) and export; the model registry and the served model."""
