"""A sweep's grid: ``sweep.KEY=[v1,v2,...]`` items into the cartesian product of points, each validated
against the config and named by its values (the name is its trial folder)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import reduce
from urllib.parse import quote

from areal_hpc.errors import UserError

# Short names of keys whose last segment is long; the paper calls the staleness bound eta.
SHORT_NAMES = {"rollout.max_head_offpolicyness": "eta"}
# Where the sweep and its runs live: the sweep sets them, so no point may change them.
PLACE_KEYS = ("experiment.name", "experiment.trial", "cluster.fileroot")


@dataclass
class SweepPoint:
    name: str
    overrides: list[str]  # this point's own key=value items, as typed
    values: dict  # key -> value as the config holds it


def split_items(items: list[str]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """``key=value`` items into the overrides of every point and the swept ``(key, [value texts])``."""
    common, axes = [], {}
    for item in items:
        key, sep, value = item.partition("=")
        if not key.startswith("sweep."):
            common.append(item)
            continue
        key = key.removeprefix("sweep.")
        texts = [t.strip() for t in value[1:-1].split(",")] if value.startswith("[") and value.endswith("]") else []
        if not sep or not texts or not all(texts):
            raise UserError(f"'{item}' is not of the form sweep.KEY=[v1,v2,...] (e.g. sweep.actor.lr=[1e-4,3e-4])")
        if key in axes:
            raise UserError(f"sweep.{key} is given twice; list all its values in one sweep.{key}=[...]")
        if key in PLACE_KEYS or key.startswith("slurm."):
            what = (
                "slurm settings are shared by the whole job array"
                if key.startswith("slurm.")
                else "the sweep sets where its runs live"
            )
            raise UserError(f"sweep.{key} cannot be swept: {what}")
        axes[key] = texts
    for item in common:
        key = item.partition("=")[0]
        if key in axes:
            raise UserError(f"{key} is both swept (sweep.{key}=[...]) and fixed ({item}); keep one")
        if key == "experiment.trial":
            raise UserError(
                "experiment.trial is set by the sweep (<sweep name>/<point name>); name the sweep with --name"
            )
    if not axes:
        raise UserError("sweep needs at least one sweep.KEY=[v1,v2,...] item (e.g. sweep.actor.lr=[1e-4,3e-4])")
    return common, list(axes.items())


def grid(config: str | list[str], common: list[str], axes: list[tuple[str, list[str]]]):
    """Every point of the grid, resolved off the nodes (``resolve(cfg, None)``): ``[(SweepPoint, RunConfig)]``.
    Any bad point is a UserError naming it, before anything is submitted."""
    from areal_hpc.config import load_config
    from areal_hpc.resolve import resolve

    keys = [key for key, _ in axes]
    points = []
    for texts in itertools.product(*(values for _, values in axes)):
        overrides = [f"{key}={text}" for key, text in zip(keys, texts)]
        try:
            cfg = resolve(load_config(config, [*common, *overrides]), None).cfg
        except UserError as exc:
            raise UserError(f"sweep point {','.join(overrides)}: {exc}") from None
        points.append((SweepPoint("", overrides, {key: _get(cfg, key) for key in keys}), cfg))
    for j, (key, texts) in enumerate(axes):  # [1e-4,0.0001] would be one run twice, in one folder
        value_of = {point.overrides[j].partition("=")[2]: point.values[key] for point, _ in points}
        seen = {}
        for text in texts:
            if value_of[text] in seen:
                raise UserError(f"sweep.{key}: {seen[value_of[text]]} and {text} are the same value; list it once")
            seen[value_of[text]] = text
    labels = _labels(keys)
    for point, _ in points:
        point.name = ",".join(f"{labels[k]}={_name_text(v)}" for k, v in point.values.items())
    return points


def _get(cfg, key: str):
    return reduce(getattr, key.split("."), cfg)


def _labels(keys: list[str]) -> dict[str, str]:
    """A point name's word per key: its short name or last segment, the full key where two would clash."""
    short = {key: SHORT_NAMES.get(key, key.rpartition(".")[2]) for key in keys}
    clash = {label for label in short.values() if list(short.values()).count(label) > 1}
    return {key: key if label in clash else label for key, label in short.items()}


def _name_text(value) -> str:
    """A value as it reads in a folder name: repr of numbers (0.0001), lower-case booleans, and text
    percent-encoded (so '/' cannot nest folders and two different values never give one name)."""
    text = str(value).lower() if isinstance(value, bool) else repr(value) if isinstance(value, float) else str(value)
    return quote(text, safe="._+-")
