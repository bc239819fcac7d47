"""lockstep pipeline stages: one module per stage plus the shared mechanisms."""
