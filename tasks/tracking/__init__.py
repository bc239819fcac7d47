"""MLflow at the edge: the pipeline's runs, the UI's training dashboard, orphaned runs."""
