"""Stages 1-3: download a source, its per-channel statistics, the preprocessed splits; and the data
formats, image decoding and checks they share."""
