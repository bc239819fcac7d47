"""A package so that tests/hosts/conftest.py's fixtures can be package-scoped: the bed is taken down
when the last of these modules ends (pytest gives a folder without __init__.py no package scope)."""
