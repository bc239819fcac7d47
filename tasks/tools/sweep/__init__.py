"""Hyperparameter search whose results do not depend on timing (`make sweep`, flows/sweep.py).

- study.py: the Optuna study, asked and told in batches by trial number; created, resumed, refused
- trials.py: one trial: its spec, seeds and params, its outcome, its pruning
- space.py: `sweep.space` as Optuna distributions; a trial read back from the storage, checked
- results.py: the study's summary, table and plots; the winner's weights from its MLflow run
- cluster.py: the Dask cluster's addresses and TLS credentials (a Dask port runs code)
"""
