"""The Prefect flows: the pipeline, its deployments, sweeps and notifications.

Prefect reads its settings once, when it is imported; importing this package applies the project's
(flows/prefect_env.py) first, so that every module here imports Prefect at its top, whichever entry
point loaded it.
"""

from flows import prefect_env

prefect_env.configure()
