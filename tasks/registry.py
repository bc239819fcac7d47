"""The MLflow model registry: register the shipped model, then decide whether it becomes champion.

Every registered version gets the alias `challenger`. The alias `champion` moves to it only if its
test accuracy is at least the current champion's (or there is no champion yet). Both numbers and
the decision are recorded on the stage run (tags and metrics) and on the model version (tags), so
the MLflow UI shows why a version was or was not promoted.

Accuracies compare the test split each model was scored on: when the data changed between the two
runs, that is a different test split, and the run records both data hashes (`data.md5` tags).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CHALLENGER, CHAMPION = "challenger", "champion"
ACCURACY_TAG = "test_accuracy"


@dataclass(frozen=True)
class Promotion:
    name: str
    version: str
    accuracy: float
    champion_version: str | None  # before this decision
    champion_accuracy: float | None
    promoted: bool


def decide_promotion(client: Any, name: str, version: str, accuracy: float) -> Promotion:
    """Alias `version` as challenger; move `champion` to it if `accuracy` >= the champion's."""
    client.set_model_version_tag(name, version, ACCURACY_TAG, repr(accuracy))
    client.set_registered_model_alias(name, CHALLENGER, version)
    champion_version = client.get_registered_model(name).aliases.get(CHAMPION)
    current = client.get_model_version(name, str(champion_version)) if champion_version is not None else None
    champion_accuracy = None
    if current is not None:
        recorded = current.tags.get(ACCURACY_TAG)
        # A champion set without an accuracy (by hand, or by an older lockstep) cannot be compared:
        # the challenger replaces it.
        champion_accuracy = float(recorded) if recorded is not None else None
    promoted = champion_accuracy is None or accuracy >= champion_accuracy
    if promoted:
        client.set_registered_model_alias(name, CHAMPION, version)
    decision = "promoted" if promoted else "kept"
    client.set_model_version_tag(name, version, "promotion", decision)
    return Promotion(
        name=name,
        version=version,
        accuracy=accuracy,
        champion_version=str(current.version) if current is not None else None,
        champion_accuracy=champion_accuracy,
        promoted=promoted,
    )
