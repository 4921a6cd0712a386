"""The planner's shipped catalog, package data so that an installed wheel carries it too.

    clusters/NAME.yaml          the papers' clusters and an example site (``--cluster NAME``)
    models/NAME/config.json     the Hugging Face configs the cost model reads (``--model NAME``)
    efficiency-areal-hex.yaml   the efficiency factors ``areal-hpc repro hex --calibrate`` fitted

Found through ``importlib.resources``, the same way in a checkout and in site-packages.
"""

from importlib.resources import files

CATALOG = files(__name__)
CLUSTERS = CATALOG / "clusters"
MODELS = CATALOG / "models"
EFFICIENCY_AREAL_HEX = CATALOG / "efficiency-areal-hex.yaml"


def cluster_names() -> list[str]:
    return sorted(entry.name.removesuffix(".yaml") for entry in CLUSTERS.iterdir() if entry.name.endswith(".yaml"))


def model_names() -> list[str]:
    return sorted(entry.name for entry in MODELS.iterdir() if (entry / "config.json").is_file())
