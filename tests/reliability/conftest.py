"""The reliability suite: each fault of issue 8 injected into the real pipeline (README, "Reliability").

Shared helpers live in tests/conftest.py; fixtures specific to one fault stay in that fault's module.
"""
