"""The correctness guard of `cognet-bench`: every engine's recommendations must equal
torch-batched's (the reference) on the same visits, or the run says MISMATCH.

A visit whose best hypotheses are a float32 near-tie can get different answers from the
reference itself at different batch sizes (GPU kernels change with the shapes: measured on
an H100, torch-cuda at batch 4,096 and 16,384 differ on 1 visit of 65,536). Every answer the
reference gave is kept; an engine matches on a visit when it gives one of them, and the
comparison reports how many visits the reference answered in more than one way.

A beam-search answer that differs from every answer of the reference is scored by the
reference model (teacher forced, float64 sums: `TorchBatched.list_scores`) with the
reference's answers: within TIE of one of them, it is a float tie, which the engine broke
the other way (an H100 gave a list that scored 1e-6 from torch-cuda's); the comparison counts
those as `ties`, and they do not make a mismatch. Anything farther is a mismatch.

Before any of that, a visit whose answer differs from the reference's is decoded again by the
reference alone (a batch of one patient): the reference's own answer can depend on its batch
(on the CPU, torch at batch 4,096 flipped a near-tie between partial hypotheses of one visit
of 4,096 that it decodes alone as every ONNX engine did). When the engine's answer is the
reference's answer alone, the visit is reported apart, as `batch_dependent` (the reference
depends on its batch, not the engine), and is no mismatch.

A set decoding lists its set in decreasing P(k in S). When the engine returns exactly the
medications of one of the reference's answers in another order, two of them had P(k in S)
equal within float32 rounding, ordered the other way: a `ties` entry (`same_set`), no
mismatch, as a beam-search float tie. A set with other medications is a difference, and a
run matches when at most SET_TOLERANCE of its visits differ."""

from __future__ import annotations

from collections.abc import Sequence

from cognet.benchmarks import engines as eng
from cognet.benchmarks.workload import Batch

SET_TOLERANCE = 0.005  # share of visits whose set may differ (float32 rounding: 99.5% equal)
# Two lists whose log-probabilities differ by at most this are a tie: float32 rounds a sum
# of ~20 log-probabilities of magnitude ~10 to ~1e-6; real differences are far larger.
TIE = 1e-5
# Differing visits scored for ties at most, per comparison (ties are rare: a run with more
# differences is broken, and its other differences count as mismatches unscored).
TIE_CHECKS = 256
# Differing visits decoded again by the reference alone, at most, per comparison (as above).
SOLO_CHECKS = 256
CPU_CHUNK, GPU_CHUNK = 32, 4096  # patients per untimed call of the reference (`Guard.chunk`)


class Guard:
    """Recommendations of torch-batched per (beam, visit_id); every run is compared to them."""

    def __init__(self, reference: eng.Engine | None):
        self.reference = reference
        # patients per untimed reference call: torch-batched's fastest on a CPU; on a GPU
        # (torch-cuda) large batches are, and 65,536 visits in calls of 32 would take minutes
        on_gpu = getattr(reference, "device", "cpu") != "cpu"
        self.chunk = GPU_CHUNK if on_gpu else CPU_CHUNK
        # (beam, visit_id) -> every distinct answer of the reference, first one first
        self.recs: dict[tuple[int, str], list[tuple[str, ...]]] = {}
        self.patients: dict[str, list] = {}  # visit_id -> its patient (the tie check)
        self._scores: dict[tuple[str, tuple[str, ...]], float] = {}
        # (beam, visit_id) -> the reference's answer for the visit decoded alone
        self._alone: dict[tuple[int, str], tuple[str, ...]] = {}

    def ensure(self, batches: Sequence[Batch], beam: int) -> None:
        """Decode (untimed, `self.chunk` patients at a time) the visits of `batches` that
        have no reference yet; then the reference hands back what it cached on the device."""
        if self.reference is None:
            return
        for b in batches:
            self.patients.update((p[-1].visit_id, p) for p in b.patients)
        todo = [p for b in batches for p in b.patients if (beam, p[-1].visit_id) not in self.recs]
        if not todo:
            return
        self.reference.prepare(beam, self.chunk)
        for lo in range(0, len(todo), self.chunk):
            part = todo[lo : lo + self.chunk]
            batch = Batch(None, part, [p[-1].visit_id for p in part])  # torch needs no table
            self.add(beam, self.reference.recommendations(batch, self.reference.run(batch)))
        self.reference.after_pass()

    def add(self, beam: int, recs: dict[str, tuple[str, ...]]) -> None:
        for vid, meds in recs.items():
            answers = self.recs.setdefault((beam, vid), [])
            if meds not in answers:
                answers.append(meds)

    def compare(self, beam: int, recs: dict[str, tuple[str, ...]], exact: bool = True) -> dict:
        """How `recs` compare with the reference; `exact` False (an approximate engine,
        `engines.APPROXIMATE`): the agreement is reported, `matches_reference` is None."""
        if self.reference is None:
            return {
                "matches_reference": None,
                "compared": 0,
                "mismatches": 0,
                "reference_ambiguous": 0,
                "ties": 0,
                "tie_examples": [],
                "batch_dependent": 0,
                "batch_dependent_examples": [],
                "examples": [],
            }
        compared, examples, bad, ambiguous, ties, solo = 0, [], 0, 0, [], []
        differ = []
        for vid, meds in recs.items():
            ref = self.recs.get((beam, vid))
            if ref is None:
                continue
            compared += 1
            ambiguous += len(ref) > 1
            if meds not in ref:
                differ.append(vid)
        alone = self._decode_alone(beam, differ)
        for vid in [v for v in differ if alone.get(v) == recs[v]]:
            solo.append(
                {
                    "visit_id": vid,
                    "reference": list(self.recs[(beam, vid)][0]),
                    "got": list(recs[vid]),
                }
            )
            differ.remove(vid)
        if beam in eng.SETS:  # the reference's medications in another order: a float tie
            for vid in [v for v in differ if _same_set(recs[v], self.recs[(beam, v)])]:
                ties.append(
                    {
                        "visit_id": vid,
                        "reference": list(self.recs[(beam, vid)][0]),
                        "got": list(recs[vid]),
                        "same_set": True,
                    }
                )
                differ.remove(vid)
        gaps = self._gaps(differ, recs, beam) if exact and beam not in eng.SETS else {}
        for vid in differ:
            ref, meds = self.recs[(beam, vid)], recs[vid]
            gap = gaps.get(vid)
            example = {"visit_id": vid, "reference": list(ref[0]), "got": list(meds)}
            if gap is not None:
                example["score_gap"] = gap
            if gap is not None and gap <= TIE:
                ties.append(example)
                continue
            bad += 1
            if len(examples) < 3:
                examples.append(example)
        # Sets near the threshold may flip with float32 rounding (batch composition, engine):
        # a set decoding run matches when at most SET_TOLERANCE of its visits differ.
        allowed = int(SET_TOLERANCE * compared) if beam in eng.SETS else 0
        return {
            "matches_reference": (bad <= allowed and compared == len(recs)) if exact else None,
            "agreement": (compared - bad) / compared if compared else None,
            "compared": compared,
            "mismatches": bad,
            "reference_ambiguous": ambiguous,
            "ties": len(ties),
            "tie_examples": ties[:3],
            "batch_dependent": len(solo),
            "batch_dependent_examples": solo[:3],
            "examples": examples,
        }

    def _decode_alone(self, beam: int, vids: list[str]) -> dict[str, tuple[str, ...]]:
        """visit_id -> the reference's answer for that visit decoded alone (a batch of its
        patient only), for the first SOLO_CHECKS of `vids` whose patient is known."""
        todo = [v for v in vids if v in self.patients and (beam, v) not in self._alone]
        todo = todo[:SOLO_CHECKS]
        if todo:
            self.reference.prepare(beam, 1)
        for vid in todo:
            batch = Batch(None, [self.patients[vid]], [vid])
            answer = self.reference.recommendations(batch, self.reference.run(batch))
            self._alone[(beam, vid)] = answer[vid]
        return {v: self._alone[(beam, v)] for v in vids if (beam, v) in self._alone}

    def _gaps(self, vids: list[str], recs: dict, beam: int) -> dict[str, float]:
        """visit_id -> the smallest |log-probability difference| between the engine's list
        and an answer of the reference, under the reference model (when it can score)."""
        scorer = getattr(self.reference, "list_scores", None)
        if scorer is None:
            return {}
        vids = [v for v in vids if v in self.patients][:TIE_CHECKS]
        wanted = list(  # (visit, list) pairs not scored yet, in order, once each
            dict.fromkeys(
                (vid, meds)
                for vid in vids
                for meds in (recs[vid], *self.recs[(beam, vid)])
                if (vid, meds) not in self._scores
            )
        )
        for lo in range(0, len(wanted), 64):
            part = wanted[lo : lo + 64]
            got = scorer([self.patients[v] for v, _ in part], [m for _, m in part])
            self._scores.update(zip(part, got.tolist(), strict=True))
        return {
            vid: min(
                abs(self._scores[(vid, recs[vid])] - self._scores[(vid, r)])
                for r in self.recs[(beam, vid)]
            )
            for vid in vids
        }


def _same_set(meds: tuple[str, ...], answers: list[tuple[str, ...]]) -> bool:
    """`meds` holds exactly the medications of one of `answers`, in another order."""
    return any(sorted(meds) == sorted(a) for a in answers)
