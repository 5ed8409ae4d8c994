"""The signature of a `cognet-batch score` run: what a `--resume` must share with the run it
finishes, so that the output never mixes results of two settings.

It holds the input file (path, size, modification time), the model (the sha256 of its
`manifest.json`, which names the sha256 of every graph, the vocabulary, the DDI pairs and
whatever else decides the model's answers), the flags `--all`, `--explain`, `--sort` and `--split`,
and every field of `ScoreOptions` except NOT_OUTPUT: a field added to the options changes
the signature unless it is listed there, so a new decoding option cannot be forgotten.

NOT_OUTPUT: the fields that decide how fast and where, not what: threads, device, batch
sizes. They may move scores in the last float32 bits (a visit decoded next to other
visits), never a medication list. The chunking they set is kept (`chunk_targets`, resolved):
a resume must cut the input where the interrupted run did.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cognet.core.manifest import MANIFEST_FILE, file_sha256
from cognet.runtime.options import ScoreOptions

NOT_OUTPUT = frozenset(
    {"device", "threads", "streams", "batch_size", "batch_slots", "encode_batch", "compact_at"}
)


@dataclass(frozen=True)
class RunFlags:
    """The flags of a `cognet-batch score` run, beside its ScoreOptions, that decide what it
    writes: --all (`score_all`: every visit, and the metrics), --explain, --sort (the input
    sorted in memory) and --split (score only that split's rows)."""

    score_all: bool = False
    explain: bool = False
    sort: bool = False
    split: str | None = None


def signature(
    input_path: str | Path,
    model_dir: str | Path,
    options: ScoreOptions,
    chunk_targets: int,
    flags: RunFlags,
) -> dict:
    """The run's signature (JSON); chunk_targets: the visits per chunk the scorer resolved."""
    stat = Path(input_path).stat()
    settings = options.to_json()
    signed = {
        "input": str(Path(input_path).resolve()),
        "input_size": stat.st_size,
        "input_mtime_ns": stat.st_mtime_ns,
        "model": file_sha256(Path(model_dir) / MANIFEST_FILE),
        "all": flags.score_all,
        "explain": flags.explain,
        "sort": flags.sort,
        "split": flags.split,
        **{name: settings[name] for name in output_fields()},
        "chunk_targets": chunk_targets,
    }
    return json.loads(json.dumps(signed))  # as progress.json holds it (tuples are lists)


def output_fields() -> list[str]:
    """The fields of ScoreOptions (its request's spelled out, `ScoreOptions.to_json`) that the
    signature holds: all but NOT_OUTPUT."""
    return [name for name in ScoreOptions().to_json() if name not in NOT_OUTPUT]
