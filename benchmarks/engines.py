"""The engines `cognet-bench` compares, behind one small interface.

An engine decodes a `workload.Batch` at a beam width and returns, untimed afterwards, the
recommended medication codes of each scored visit. Engines:

- `torch-perpatient`: the paper's way (`benchmarks.perpatient`): one patient at a time, no
  KV cache, a Python beam object per visit (one network: skipped for an ensemble);
- `torch-batched`: the torch reference batched beam search
  (`cognet.model.torch_decoding.beam_search`, an ensemble by its rules);
- `torch-cuda`: the same on a CUDA device;
- `ort-cpu`, `ort-cuda`, `ort-tensorrt`: the runtime (`cognet.runtime.Scorer`) on each
  ONNX Runtime execution provider, with its default candidate selection (`--selection auto`:
  numpy on the host for the CPU, the search graphs on a GPU);
- `ort-cpu-device`, `ort-cuda-host`: the same with the other selection
  (`runtime/device_selectors.py`), to measure one against the other;
- `ort-cpu-fp16`, `ort-cuda-fp16`: the runtime on the model's float16 graphs (`cognet-export
  --fp16`); their lists are compared with the reference and the agreement reported, not
  required (APPROXIMATE);
- `ort-cpu-int8`: the runtime on the model's int8 graphs (`cognet-export --int8`, CPU only),
  APPROXIMATE too; the demo model is exported with them when this engine is selected;
- `ort-cpu-gpupath`: what a GPU runs, on the CPU provider (`OrtModel(gpu_path=True)`: IO
  binding into CPU memory, encodings gathered by init_gather, the split selection graphs):
  its Python time is the GPU path's host side, measurable without a GPU (`--profile`);
- `ort-cuda-streams`: ort-cuda with 4 host threads feeding the GPU (`ScoreOptions.streams`):
  batches of one call decode in parallel, so it differs from ort-cuda in the stream mode
  (a call per batch, the request mode, has one batch to decode);
- `ort-cuda-fp16-streams`: both levers at once (the float16 graphs, 4 host threads).

Every engine but `torch-perpatient` runs the decodings of `--beams`: beam widths, the
model's set decoding (`SET`) and its marginal decoding (`MARGINAL`: the set head, one pass;
the runtime runs the head's graph alone, the torch engines the head of the checkpoint).

`availability(name)` says why an engine cannot run here (None when it can), so that the
results name every skipped engine with its reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from cognet.benchmarks.workload import Batch
from cognet.core.decoding import BEAM, MAX_LEN, Decoding
from cognet.core.decoding.ensemble import mix_log_probs
from cognet.core.decoding.plan import DecodingPlan
from cognet.core.decoding.request import DecodingRequest
from cognet.core.errors import InputError
from cognet.core.manifest import load_manifest
from cognet.model.checkpoint_checks import members

TORCH_ENGINES = ("torch-perpatient", "torch-batched", "torch-cuda")
ORT_DEVICES = {
    "ort-cpu": "cpu",
    "ort-cpu-device": "cpu",
    "ort-cpu-fp16": "cpu",
    "ort-cpu-int8": "cpu",
    "ort-cpu-gpupath": "cpu",
    "ort-cuda": "cuda",
    "ort-cuda-host": "cuda",
    "ort-cuda-fp16": "cuda",
    "ort-cuda-streams": "cuda",
    "ort-cuda-fp16-streams": "cuda",
    "ort-tensorrt": "tensorrt",
}
ENGINES = ("torch-perpatient", "torch-batched", *ORT_DEVICES, "torch-cuda")  # in report order
# the candidate selection of each runtime engine (`cognet.runtime.options.SELECTIONS`)
ORT_SELECTIONS = {"ort-cpu-device": "device", "ort-cuda-host": "host"}
# the manifest variant
ORT_VARIANTS = {
    "ort-cpu-fp16": "fp16",
    "ort-cpu-int8": "int8",
    "ort-cuda-fp16": "fp16",
    "ort-cuda-fp16-streams": "fp16",
}
ORT_STREAMS = {"ort-cuda-streams": 4, "ort-cuda-fp16-streams": 4}  # host threads
GPU_PATH = ("ort-cpu-gpupath",)  # the GPU's code path on the CPU provider
APPROXIMATE = tuple(ORT_VARIANTS)  # their agreement with the reference reported
GPU_ENGINES = (*(e for e, device in ORT_DEVICES.items() if device != "cpu"), "torch-cuda")
SET = 0  # in a list of beam widths: the model's set decoding (`cognet.core.decoding`)
MARGINAL = -1  # in a list of beam widths: the model's marginal decoding (its set head)
SETS = (SET, MARGINAL)  # the decodings that answer sets (in decreasing P(k in S))
DECODING_NAMES = {"set": SET, "marginal": MARGINAL}  # as `--beams` names them


def decoding_label(beam: int) -> str:
    """How a run's decoding is named: "set", "marginal", or "beam B"."""
    names = {v: k for k, v in DECODING_NAMES.items()}
    return names.get(beam, f"beam {beam}")


class Engine(Protocol):
    name: str
    providers: list[str]
    load_s: float  # seconds to load the model (first load)

    def prepare(self, beam: int, batch_size: int) -> None:
        """Set beam width and batch size before the runs that use them."""

    def run(self, batch: Batch) -> Any:
        """Decode the batch (timed)."""

    def recommendations(self, batch: Batch, output: Any) -> dict[str, tuple[str, ...]]:
        """visit_id -> medication codes in generation order (untimed)."""

    def gpu_memory_mb(self) -> float | None:
        """Peak device memory since the last `prepare`, when the engine uses a GPU."""

    def release(self) -> None:
        """Drop what the last run allocated (so that it does not count in the next run)."""

    def after_pass(self) -> None:
        """Hand back what one pass cached and the next engine's pass may need (device memory
        between the engines of a block, which share the device)."""


def availability(name: str, checkpoint: Path | None, model_dir: Path | None = None) -> str | None:
    """Why `name` cannot run on this machine, or None."""
    if name not in ENGINES:
        return f"unknown engine (choose from {', '.join(ENGINES)})"
    if name in TORCH_ENGINES:
        try:
            import torch
        except ImportError:
            return "torch is not installed (the [train] extra)"
        if checkpoint is None:
            return "needs the torch checkpoint (--checkpoint)"
        if name == "torch-cuda" and not torch.cuda.is_available():
            return "torch.cuda.is_available() is False"
        if name == "torch-perpatient" and _members(checkpoint) > 1:
            return "the paper's per-patient decoding runs one network, not an ensemble"
        return None
    try:
        import onnxruntime as ort
    except ImportError:
        return "onnxruntime is not installed"
    if name in ORT_VARIANTS and model_dir is not None:
        variant = ORT_VARIANTS[name]
        if variant not in load_manifest(model_dir, verify=False).variants:
            return f"the model has no {variant} graphs (cognet-export --{variant})"
    if name in GPU_PATH and model_dir is not None:
        if not load_manifest(model_dir, verify=False).search:
            return "the model has no search graphs (exported before them)"
    wanted = {
        "cuda": "CUDAExecutionProvider",
        "tensorrt": "TensorrtExecutionProvider",
    }.get(ORT_DEVICES[name])
    if wanted and wanted not in ort.get_available_providers():
        return (
            f"onnxruntime has no {wanted} (available: {', '.join(ort.get_available_providers())})"
        )
    return None


def load(name: str, model_dir: Path, checkpoint: Path | None, threads: int) -> Engine:
    if name in ORT_DEVICES:
        return OrtEngine(name, model_dir, threads)
    if name == "torch-perpatient":
        return TorchPerPatient(checkpoint, threads)
    return TorchBatched(name, checkpoint, threads, "cuda" if name == "torch-cuda" else "cpu")


class _TorchBase:
    def __init__(self, name: str, checkpoint: Path, threads: int, device: str = "cpu"):
        # torch (the [train] extra), in each torch engine's methods: lazy, so that --help and
        # the runtime engines run without it
        import torch

        from cognet.model import checkpoint as ckpt

        torch.set_num_threads(threads)
        started = time.perf_counter()
        self.model, self.vocab, config = ckpt.load(checkpoint, device=device)
        self.set_decoding = Decoding.from_json(config.get("decoding"))  # for beam == SET
        self.head = ckpt.load_head(checkpoint, config)  # for beam == MARGINAL (None: none)
        self.load_s = time.perf_counter() - started
        self.name, self.device = name, device
        self.providers = [f"torch {torch.__version__} {device}"]
        self.beam = 4

    def prepare(self, beam: int, batch_size: int) -> None:
        self.beam = beam
        if self.device == "cuda":
            import torch

            torch.cuda.reset_peak_memory_stats()

    def recommendations(self, batch: Batch, output) -> dict[str, tuple[str, ...]]:
        codes = self.vocab.medications
        return {
            vid: tuple(codes[m] for m in meds)
            for vid, meds in zip(batch.visit_ids, output, strict=True)
        }

    def gpu_memory_mb(self) -> float | None:
        if self.device != "cuda":
            return None
        import torch

        return torch.cuda.max_memory_allocated() / 2**20

    def release(self) -> None:
        self.after_pass()

    def after_pass(self) -> None:
        # torch's caching allocator keeps a pass's peak reserved (tens of GB at large GPU
        # batches), which the onnxruntime engines taking their turn next would run out of
        if self.device == "cuda":
            import torch

            torch.cuda.empty_cache()


class TorchBatched(_TorchBase):
    """`cognet.model.torch_decoding.beam_search` over the scored visits of the batch, all at
    once."""

    def run(self, batch: Batch) -> list[tuple[int, ...]]:
        import torch

        from cognet.model import batching, torch_decoding  # torch: lazy (see __init__)

        tensors = batching.make_batch(batch.patients, self.vocab, targets=False)
        last = torch.as_tensor(_last_rows(batch.patients))
        if self.device != "cpu":
            tensors = {k: v.to(self.device) for k, v in tensors.items()}
            last = last.to(self.device)
        if self.beam == MARGINAL:  # the head reads every visit; the last ones are scored
            marginal = DecodingRequest(decoding="marginal")
            plan = DecodingPlan.of(marginal, self.set_decoding, end=self.vocab.end)
            # the head stays on the CPU (`SetHead.marginals` feeds it host arrays)
            args = (self.model, self.vocab, batch.patients, plan)
            decoded = torch_decoding.marginal_decode(self.head, *args)
            return [decoded[i].meds for i in _last_rows(batch.patients)]
        if self.beam == SET:
            decoded = torch_decoding.set_decode(
                self.model, tensors, batch.visit_ids, self.set_decoding, rows=last
            )
            return [d.meds for d in decoded]
        return [
            d.meds
            for d in torch_decoding.beam_search(self.model, tensors, beam=self.beam, rows=last)
        ]

    def list_scores(self, patients: Sequence[Sequence], lists: Sequence[Sequence[str]]):
        """float64 [N]: the model's log-probability of each patient's last visit getting
        lists[i] (medication codes in generation order, then END unless the list is as long
        as the decoding allows): a beam's score, teacher forced; sums in float64. An
        ensemble's steps are its members' token-level mixture, as its beam search scores
        them (`cognet.core.decoding.ensemble.mix_log_probs`)."""
        import torch

        from cognet.model import batching, ensemble, network  # torch: lazy (see __init__)

        vocab = self.vocab
        index = {code: i for i, code in enumerate(vocab.medications)}
        ids = [[index[c] for c in meds] for meds in lists]
        width = max(map(len, ids), default=0) + 1
        tokens = np.full((len(ids), width), vocab.end, np.int64)
        targets = np.full((len(ids), width), vocab.end, np.int64)
        counted = np.zeros((len(ids), width), bool)
        for i, seq in enumerate(ids):
            tokens[i, 0] = vocab.start
            tokens[i, 1 : len(seq) + 1] = seq
            targets[i, : len(seq)] = seq
            counted[i, : len(seq) + (len(seq) < MAX_LEN)] = True
        batch = batching.make_batch(patients, vocab, targets=False)
        batch = batching.select_rows(batch, torch.as_tensor(_last_rows(patients)))
        batch = {k: v.to(self.device) for k, v in batch.items()}
        steps = []  # each member's log_probs [N, width, V1], where it ran
        with torch.no_grad():
            for model in ensemble.members_of(self.model):
                codes = (batch["diagnoses"], batch["procedures"], batch["medications"])
                enc = model.encode_visits(*codes)
                memories = model.decoder_init(*network.history_inputs(batch, *enc, model.cfg))
                fed = torch.as_tensor(tokens).to(self.device)
                steps.append(model.decode_teacher_forced(fed, memories)[0])
        picks = torch.as_tensor(targets).to(self.device)[..., None]
        if len(steps) == 1:  # one network: only the picked entries leave the device
            picked = steps[0].gather(2, picks)[..., 0].double().cpu().numpy()
        else:
            logp = mix_log_probs([x.cpu().numpy() for x in steps])
            picked = np.take_along_axis(logp, targets[..., None], 2)[..., 0].astype(np.float64)
        return np.where(counted, picked, 0.0).sum(1)


class TorchPerPatient(_TorchBase):
    def __init__(self, checkpoint: Path, threads: int):
        super().__init__("torch-perpatient", checkpoint, threads)

    def run(self, batch: Batch) -> list[tuple[int, ...]]:
        from cognet.benchmarks.perpatient import decode_perpatient  # torch: lazy (see __init__)

        return decode_perpatient(self.model, batch.patients, self.vocab, self.beam)


class OrtEngine:
    """`cognet.runtime.Scorer` on one execution provider; one scorer per (beam, batch size)."""

    def __init__(self, name: str, model_dir: Path, threads: int):
        self.name, self.model_dir, self.threads = name, model_dir, threads
        self.device = ORT_DEVICES[name]
        self.selection = ORT_SELECTIONS.get(name, "auto")
        self.variant = ORT_VARIANTS.get(name)
        self.streams = ORT_STREAMS.get(name)
        self.scorer = None
        self.load_s = self._load(BEAM, 256)
        self.providers = list(self.scorer.providers)

    def options(self, beam: int, batch_size: int):
        """The `cognet.runtime.ScoreOptions` of a run at this beam width and batch size."""
        common = {
            "device": self.device,
            "threads": self.threads,
            "batch_size": batch_size,
            "selection": self.selection,
            "variant": self.variant,
            "streams": self.streams,
        }
        if beam == SET:  # the model's set decoding
            return score_options(decoding="set", **common)
        if beam == MARGINAL:  # the model's set head
            return score_options(decoding="marginal", **common)
        return score_options(decoding="beam", beam=beam, **common)

    def _load(self, beam: int, batch_size: int) -> float:
        started = time.perf_counter()
        self.scorer = None  # free the previous sessions first
        self.scorer = scorer(self.model_dir, self.options(beam, batch_size), self.name in GPU_PATH)
        return time.perf_counter() - started

    def prepare(self, beam: int, batch_size: int) -> None:
        if self.scorer is None or self.scorer.options != self.options(beam, batch_size):
            self._load(beam, batch_size)

    def release(self) -> None:
        self.scorer = None  # its sessions' memory arenas go with it

    def after_pass(self) -> None:
        pass  # its arenas stay for its next pass (freeing them would time their regrowth)

    def run(self, batch: Batch):
        return [chunk.recommendations for chunk in self.scorer.score_table(batch.table)]

    def recommendations(self, batch: Batch, output) -> dict[str, tuple[str, ...]]:
        out = {}
        for table in output:
            for vid, meds in zip(
                table["visit_id"].to_pylist(), table["medications"].to_pylist(), strict=True
            ):
                out[vid] = tuple(meds)
        return out

    def gpu_memory_mb(self) -> float | None:
        if self.device == "cpu":
            return None
        return nvidia_smi_memory_mb()


def scorer(model_dir: Path, options, gpu_path: bool = False):
    """A `cognet.runtime.Scorer` of the model for `options`; gpu_path: the GPU's code path on
    the CPU provider."""
    # onnxruntime, through the runtime: lazy, so that --help and the torch engines run
    # without it (the [cpu] or [gpu] extra)
    from cognet.runtime.scorer import Scorer, open_model

    return Scorer(open_model(model_dir, options, gpu_path), options)


def score_options(**fields):
    """`cognet.runtime.ScoreOptions.of(**fields)`: the runtime's options, its defaults for
    the fields not given."""
    from cognet.runtime.options import ScoreOptions  # onnxruntime: lazy, as in `scorer`

    return ScoreOptions.of(**fields)


def nvidia_smi(*query: str) -> str | None:
    """stdout of `nvidia-smi QUERY... --format=csv,noheader,nounits` (None when unavailable)."""
    try:
        return subprocess.run(
            ["nvidia-smi", *query, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def nvidia_smi_memory_mb() -> float | None:
    """GPU memory this process holds now, from nvidia-smi (None when unavailable)."""
    out = nvidia_smi("--query-compute-apps=pid,used_memory")
    if out is None:
        return None
    for line in out.splitlines():
        pid, _, used = line.partition(",")
        if pid.strip() == str(os.getpid()):
            return float(used)
    return None


def _members(checkpoint: Path) -> int:
    """The networks of a checkpoint (`cognet.model.checkpoint_checks.members`; 1 when unreadable:
    loading it says why)."""
    try:
        config = json.loads((Path(checkpoint) / "config.json").read_text())
        return members(Path(checkpoint), config) if isinstance(config, dict) else 1
    except (OSError, ValueError, InputError):
        return 1


def _last_rows(patients: Sequence[Sequence]) -> list[int]:
    rows, at = [], 0
    for p in patients:
        at += len(p)
        rows.append(at - 1)
    return rows
