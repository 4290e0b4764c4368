"""Where prompts come from, in the layouts people bring: a JSONL, Parquet or CSV file, a `datasets` `save_to_disk`
directory (one split, or several to choose from), or a hub dataset id (with its split and subset, read through
`datasets` from the Hugging Face cache, or from the hub unless HF_HUB_OFFLINE=1). Columns are mapped by
`data.fields` onto what a run reads: `prompt` (or `messages`, chat turns) and `answer`; every other column travels
with the prompt to the reward functions.

JSONL and Parquet files are read here, so a malformed row is reported with its file and line; the other layouts go
through `datasets`. The order of the rows is the source's; the run's sampler shuffles them by seed and epoch, which
is what makes a resumed run draw the same prompts.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from grpo_dist.config.sections import FieldsConfig
from grpo_dist.data.dataset import MISSING, SUPPORTED_SUFFIXES, DatasetError, check_row, load_rows, lookup

HUB_DATASET = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
CSV_SUFFIXES = (".csv",)


def read_source(
    location: str, split: str, subset: str | None, fields: FieldsConfig, key: str, revision: str | None = None
) -> list[dict[str, Any]]:
    """The rows of the data at `location` (config key `key`: data.path, data.eval_path), checked and mapped: each
    holds `prompt` or `messages`, `answer` when `fields.answer` names a column, and the source's other columns. A
    hub dataset is read at `revision` (a branch, tag or commit; main when None)."""
    column = fields.messages or fields.prompt
    messages = fields.messages is not None
    path = Path(location).expanduser()
    if path.is_file() and path.suffix.lower() in SUPPORTED_SUFFIXES:  # read here: errors name the file's line
        rows, named = load_rows(path, column, messages), str(path)
    else:
        if path.is_file() and path.suffix.lower() in CSV_SUFFIXES:
            rows, named = _through_datasets("csv", None, "train", key, data_files=str(path)), str(path)
        elif path.is_dir():
            rows, named = _from_disk(path, split, key), f"{path} ({split})"
        elif path.suffix.lower() in (*SUPPORTED_SUFFIXES, *CSV_SUFFIXES) or not HUB_DATASET.fullmatch(location):
            raise DatasetError(f"{key}: {location}: no such file or directory (resolved to {path.resolve()})")
        else:
            named = f"{location} ({subset or 'default'}, {split})"
            rows = _from_hub(location, subset, split, key, revision)
        rows = [check_row(row, column, f"{named}: row {n}", messages) for n, row in enumerate(rows, 1)]
    if not rows:
        raise DatasetError(f"{key}: {named} has no rows")
    base_dir = path.parent if path.is_file() else path if path.is_dir() else None
    mapped = [_mapped(row, fields, named, number, key) for number, row in enumerate(rows, 1)]
    if fields.images is not None:
        for number, (row, source) in enumerate(zip(mapped, rows, strict=True), 1):
            where = f"{named}: row {number}"
            row["images"], row[IMAGE_SOURCES] = _images(source, fields.images, where, base_dir, key)
    return mapped


IMAGE_SOURCES = "image_sources"
"""The key of a mapped row's images' names, beside `images` (where `data.fields.images` is set): what `grpo-dist
check` shows of them."""


def _images(
    row: dict[str, Any], column: str, where: str, base_dir: Path | None, key: str
) -> tuple[list[bytes], list[str]]:
    """The images in `row`'s column `column` (one, or a list of them) as PNG bytes (`grpo_dist.models.vision`), and
    each one's name: its path, or where it is in the row."""
    from grpo_dist.models.vision import ImageError, encoded, source_name

    found = lookup(row, column)
    if found is MISSING:
        raise DatasetError(
            f"{where}: no images column {column!r} (data.fields.images; columns: {sorted(row)}): map it to the "
            f"column that holds the row's images, or set it to null for text prompts ({key})"
        )
    found = found if isinstance(found, list) else [] if found is None else [found]
    if not found:  # every rank's forward must run the vision tower, as every other rank's does
        raise DatasetError(
            f"{where}: no image in its column {column!r} (data.fields.images): every row of a run on images needs"
            f" one at least; drop the rows without ({key})"
        )
    try:
        images = [encoded(image, f"{where}, {column}[{at}]", base_dir) for at, image in enumerate(found)]
    except ImageError as err:
        raise DatasetError(f"{err} ({key})") from None
    return images, [source_name(image, f"{column}[{at}]") for at, image in enumerate(found)]


def _mapped(row: dict[str, Any], fields: FieldsConfig, named: str, number: int, key: str) -> dict[str, Any]:
    answer = MISSING if fields.answer is None else lookup(row, fields.answer)
    if fields.answer is not None and answer is MISSING:
        raise DatasetError(
            f"{named}: row {number}: no answer column {fields.answer!r} (data.fields.answer; columns: "
            f"{sorted(row)}): map it to the column that holds the reference answer (a dotted path reaches into a "
            f"nested one), or set it to null when the rewards need none ({key})"
        )
    prompt_column = fields.messages or fields.prompt
    taken = (prompt_column, fields.answer, fields.images)
    mapped = {name: value for name, value in row.items() if name not in taken}
    mapped["messages" if fields.messages else "prompt"] = lookup(row, prompt_column)
    if answer is not MISSING:
        mapped["answer"] = answer
    return mapped


def _from_disk(path: Path, split: str, key: str) -> list[dict[str, Any]]:
    """A `save_to_disk` directory: one split, or a dict of splits to take `split` from."""
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as err:
        raise DatasetError(
            f"{key}: {path} is a directory but not one `datasets.save_to_disk` wrote ({err}); name a file in it "
            "or the directory a dataset was saved to"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DatasetError(f"{key}: {path} has no split {split!r} (it has {sorted(loaded)}); set the split")
        loaded = loaded[split]
    return loaded.to_list()


def _from_hub(repo_id: str, subset: str | None, split: str, key: str, revision: str | None) -> list[dict[str, Any]]:
    """A hub dataset: its snapshot resolved like a hub model's (from the Hugging Face cache, or downloaded there),
    then read by `datasets` from that directory (its README's configs name the subsets and splits)."""
    from grpo_dist.models.hub import snapshot

    return _through_datasets(snapshot(repo_id, revision, key, kind="dataset"), subset, split, key)


def _through_datasets(name: str, subset: str | None, split: str, key: str, **options: Any) -> list[dict[str, Any]]:
    """`datasets.load_dataset`, its failures as one line naming `key`."""
    import datasets

    try:
        return datasets.load_dataset(name, subset, split=split, **options).to_list()
    except ValueError as err:  # an unknown split or subset; the message lists the ones there are
        raise DatasetError(f"{key}: {' '.join(str(err).split())[:400]} (data.split, data.subset)") from None
    except (FileNotFoundError, OSError) as err:
        raise DatasetError(f"{key}: {name}: cannot be read ({' '.join(str(err).split())[:300]})") from None
