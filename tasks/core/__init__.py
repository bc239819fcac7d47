"""What every stage and tool shares: the config, the project's layout, errors, atomic writes, hashing,
redaction, the command line and the project lock."""
