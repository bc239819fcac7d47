"""The Prefect flows: the pipeline, its deployments, sweeps and notifications.

Importing a module here configures nothing: each entry point applies Prefect's settings first, by an
explicit call (flows/prefect_settings.py `configure`), and pins its process (tasks/determinism/bootstrap.py).
"""
