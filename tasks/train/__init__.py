"""Stages 4-5: train a model (one process or DDP) and evaluate it; models, checkpoints, resume, pretrained weights."""
