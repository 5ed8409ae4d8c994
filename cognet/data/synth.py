"""Synthetic EHR datasets shaped like the processed MIMIC-III benchmark of the COGNet paper.

A seeded *world* of latent conditions drives every patient:

- chronic conditions (diabetes-, heart-failure-like) persist across visits, sometimes
  resolve, and new ones appear; their codes are seldom recorded after all, as in billing
  data. Acute conditions (pneumonia-, sepsis-like) come with a visit, always coded;
- each condition emits diagnosis codes, procedure codes and fills medication *slots*: a
  slot has a few ATC-3 alternatives; the patient's pick is made when the condition starts
  and kept (rarely switched) while it lasts, avoiding drugs that interact with the
  patient's other picks. Chronic slots draw from a wider range of medications than acute
  ones, so popularity alone seldom guesses them;
- each patient is treated at one of a few sites (hospitals, never coded) which weigh a
  slot's alternatives their own way and rarely use one of the ward medications;
- a visit severity (visible through ICU-type procedure and diagnosis codes) drives ten
  ward medications given at most visits, and how many slots are filled;
- patient-level comorbidity codes and a long Zipf tail of unrelated codes fill the rest.

So medications follow from the current codes (which acute conditions, how severe) and from
history (which chronic drugs this patient is on, which site treats them): a model using
both beats copying the previous visit and beats a per-medication regression on the
current codes alone. At the defaults (seed 0, test split, patient-averaged Jaccard):
copy-last 0.46, most-frequent 0.45, logistic regression on codes 0.51, the same regression
given the medications of earlier visits 0.54.

Interacting pairs (`ddi.parquet`) are drawn with odds growing with how often the two
medications meet in a pilot cohort simulated before DDI, tuned so the ground-truth DDI rate
of the data lands near the paper's 0.09.

Defaults reproduce the paper's MIMIC-III statistics at 6,350 patients. Patients are
generated one by one from their own seeded random stream (patient i is the same whatever the
cohort size) and written in row groups of whole patients, so memory stays bounded for any
N. `visits.parquet` carries a `split`
column, `cognet.core.dataset.split_patients(N, seed)`: what `read_dataset(split_seed=seed)` would
draw for a file without one.

The world (codes, conditions, sites and their knobs) is drawn by `cognet.data.synth_world`;
this module draws the patients and the DDI pairs from it and writes the files.
"""

from __future__ import annotations

import bisect
import math
import os
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

from cognet.core.dataset import (
    DDI_FILE,
    SPLITS,
    VISITS_FILE,
    VISITS_SCHEMA,
    split_patients,
    write_ddi,
    write_visits,
)
from cognet.data.synth_world import (
    MEDICATIONS,
    N_SITES,
    SEVERITY_DIAG,
    SEVERITY_PROC,
    World,
    build_world,
    with_ddi,
    zipf_cum,
)

# -- knobs of the patients (tuned against the paper's dataset statistics) ---------------------

P_VISITS = {1: 0.14, 2: 0.60}  # the rest: 3..MAX_VISITS with P ~ (n - 2)^-VISITS_TAIL
MAX_VISITS, VISITS_TAIL = 29, 2.1
CHRONIC_AT_START, P_CHRONIC_ONSET, P_CHRONIC_RESOLVE = 3.1, 0.3, 0.15
ACUTE_EXTRA, P_ACUTE_CARRY = 4.2, 0.0  # per visit: 1 + Poisson(ACUTE_EXTRA) acute conditions
FRAILTY_SHAPE = 1.5  # gamma shape of a patient's multiplier of the two rates above
VISIT_SHAPE = 1.2  # gamma shape of a visit's own multiplier of the acute rate
P_CORE = (0.15, 0.95)  # chance a (chronic, acute) condition's core code is recorded
P_SWITCH = 0.05  # chance per visit that a kept pick is drawn again
DDI_AVOID = 0.08  # odds multiplier of an alternative that interacts with the patient's picks
P_SEVERITY = (0.15, 0.35, 0.32, 0.18)  # short stay, ward, serious, ICU
WARD_SCALE = (0.3, 0.95, 1.1, 1.25)  # ward-medication odds by severity
# chance that a slot of an (acute, chronic) condition is filled, by severity
P_SLOT = ((0.3, 0.7, 0.9, 1.0), (0.4, 0.8, 0.95, 1.0))
P_WARD_OFF = 0.04  # chance a patient never takes a given ward medication
N_COMORBID, P_COMORBID = 4, 0.9  # patient-level codes and their per-visit emission
NOISE_DIAG, NOISE_PROC = 0.1, 0.5  # mean unrelated codes per visit (gamma-Poisson)
MAX_DIAG, MAX_PROC, MAX_MEDS = 39, 32, 53
# Share of a pilot cohort's co-prescribed pairs that the DDI pairs cover; avoidance then
# brings the ground-truth DDI rate of the data down to about 0.09.
N_DDI, DDI_SHARE = 448, 0.101
N_PILOT = 1500
DEFAULT_ROW_GROUP = 65536


# -- patients -------------------------------------------------------------------------------


def _poisson(rng: random.Random, lam: float) -> int:
    """Knuth's Poisson sampler (lam is small here)."""
    limit, k, p = math.exp(-lam), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def _n_visits(rng: random.Random) -> int:
    u = rng.random()
    for n, p in P_VISITS.items():
        if u < p:
            return n
        u -= p
    return 3 + _draw(rng, _TAIL_CUM)


_TAIL_CUM = zipf_cum(MAX_VISITS - 2, VISITS_TAIL)  # 3..MAX_VISITS visits
_SEVERITY_CUM = tuple(np.cumsum(P_SEVERITY).tolist())


def _draw(rng: random.Random, cum: tuple[float, ...]) -> int:
    """Index drawn with cumulative weights `cum` (what random.choices does, without overhead)."""
    return bisect.bisect(cum, rng.random() * cum[-1], 0, len(cum) - 1)


def _pick(
    rng: random.Random,
    alts: tuple[int, ...],
    weights: tuple[float, ...],
    partners: int,
    taken: int,
    interacts: tuple[int, ...],
) -> int:
    """One alternative of a slot, those interacting with the `taken` bit mask made unlikely.

    `partners`: bit mask of every medication some alternative interacts with."""
    if len(alts) == 1:
        return alts[0]
    if partners & taken:
        weights = [
            w * DDI_AVOID if interacts[a] & taken else w for a, w in zip(alts, weights, strict=True)
        ]
    u = rng.random() * sum(weights)
    for a, w in zip(alts, weights, strict=True):
        u -= w
        if u < 0:
            return a
    return alts[-1]


def _patient(world: World, rng: random.Random) -> list[tuple[list, list, list]]:
    """The visits of one patient: diagnosis codes, procedure codes, medication ids."""
    conds = world.conditions
    active: dict[int, list[int]] = {}  # condition id -> picked medication per slot

    held = 0  # bit mask of the medications picked for the active conditions

    def taken() -> int:
        mask = 0
        for picks in active.values():
            for m in picks:
                mask |= 1 << m
        return mask

    def start(c: int) -> None:
        nonlocal held
        if c not in active:
            picks = [
                _pick(rng, alts, weights[site], partners, held, world.interacts)
                for alts, weights, partners in conds[c].slots
            ]
            active[c] = picks
            for m in picks:
                held |= 1 << m

    n_visits = _n_visits(rng)
    site = rng.randrange(N_SITES)
    frailty = rng.gammavariate(FRAILTY_SHAPE, 1.0 / FRAILTY_SHAPE)  # mean 1
    for _ in range(_poisson(rng, CHRONIC_AT_START * frailty)):
        start(_draw(rng, world.chronic_cum))
    # a tuple, not a set: set order follows string hashes, which differ between processes
    drawn = (world.comorbid[_draw(rng, world.comorbid_cum)] for _ in range(N_COMORBID))
    comorbid = tuple(dict.fromkeys(drawn))
    ward = [p if rng.random() >= P_WARD_OFF else p * 0.05 for p in world.ward_p[site]]

    visits = []
    for v in range(n_visits):
        if v:
            for c in list(active):
                keep = (1 - P_CHRONIC_RESOLVE) if conds[c].chronic else P_ACUTE_CARRY
                if rng.random() >= keep:
                    del active[c]
            held = taken()
            if rng.random() < P_CHRONIC_ONSET:
                start(_draw(rng, world.chronic_cum))
            for c, picks in active.items():
                for s, (alts, weights, partners) in enumerate(conds[c].slots):
                    if len(alts) > 1 and rng.random() < P_SWITCH:
                        picks[s] = _pick(
                            rng, alts, weights[site], partners, taken(), world.interacts
                        )
                        held = taken()
        burden = rng.gammavariate(VISIT_SHAPE, 1.0 / VISIT_SHAPE)  # mean 1
        for _ in range(1 + _poisson(rng, ACUTE_EXTRA * frailty * burden)):
            start(world.n_chronic + _draw(rng, world.acute_cum))
        visits.append(_emit(world, rng, active, comorbid, ward))
    return visits


def _emit(
    world: World,
    rng: random.Random,
    active: dict[int, list[int]],
    comorbid: tuple[str, ...],
    ward: list[float],
) -> tuple[list, list, list]:
    """One visit's codes from the active conditions, the severity and the background."""
    rand = rng.random
    diag: dict[str, None] = {}  # ordered sets
    proc: dict[str, None] = {}
    meds: dict[int, None] = {}
    severity = _draw(rng, _SEVERITY_CUM)
    for c, picks in active.items():
        cond = world.conditions[c]
        p_slot = P_SLOT[cond.chronic][severity]
        p_core = P_CORE[0] if cond.chronic else P_CORE[1]
        for code in cond.core:
            if rand() < p_core:
                diag[code] = None
        for code in cond.secondary:
            if rand() < cond.p_secondary:
                diag[code] = None
        for code, p in cond.procedures:
            if rand() < p:
                proc[code] = None
        for med in picks:
            if rand() < p_slot:
                meds[med] = None
    for code in comorbid:
        if rand() < P_COMORBID:
            diag[code] = None
    for code in SEVERITY_DIAG[: 2 * severity]:
        if rand() < 0.4:
            diag[code] = None
    for code in SEVERITY_PROC[: 3 * severity]:
        if rand() < 0.1 * severity:
            proc[code] = None
    scale = WARD_SCALE[severity]
    for med, p in enumerate(ward):
        if rand() < p * scale:
            meds[med] = None
    n_noise = _poisson(rng, rng.gammavariate(2.0, NOISE_DIAG / 2.0))
    for _ in range(n_noise):
        diag[world.noise_diag[_draw(rng, world.noise_diag_cum)]] = None
    n_noise = _poisson(rng, rng.gammavariate(0.4, NOISE_PROC * (0.5 + severity) / 0.4))
    for _ in range(n_noise):
        proc[world.noise_proc[_draw(rng, world.noise_proc_cum)]] = None
    if not diag:  # every visit has a reason: the core code of its newest condition
        diag[world.conditions[next(reversed(active))].core[0]] = None
    if not meds:
        meds[0] = None
    return list(diag)[:MAX_DIAG], list(proc)[:MAX_PROC], list(meds)[:MAX_MEDS]


def _patient_rng(seed: int, index: int) -> random.Random:
    return random.Random(f"cognet-synth/{seed}/{index}")


# -- interacting pairs --------------------------------------------------------------------------


def _choose_ddi(world: World, seed: int) -> list[tuple[int, int]]:
    """N_DDI medication pairs covering about DDI_SHARE of a pilot cohort's co-prescribed pairs.

    Pairs are drawn without replacement with odds (co-prescriptions + 1)^alpha (Gumbel top-k),
    alpha found by bisection; the same Gumbel noise at every alpha keeps the draw monotone.
    """
    n_med = len(MEDICATIONS)
    co = np.zeros((n_med, n_med))
    for i in range(N_PILOT):
        for _, _, meds in _patient(world, random.Random(f"cognet-synth-pilot/{seed}/{i}")):
            co[np.ix_(meds, meds)] += 1
    a, b = np.triu_indices(n_med, k=1)
    pair_co = co[a, b]
    total = pair_co.sum()
    gumbel = -np.log(-np.log(np.random.default_rng([seed, 2]).random(len(pair_co))))

    def draw(alpha: float) -> np.ndarray:
        return np.argpartition(-(alpha * np.log1p(pair_co) + gumbel), N_DDI)[:N_DDI]

    lo, hi = 0.0, 4.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if pair_co[draw(mid)].sum() / total < DDI_SHARE else (lo, mid)
    chosen = draw((lo + hi) / 2)
    return sorted((int(a[i]), int(b[i])) for i in chosen)


# -- writing --------------------------------------------------------------------------------


def _batches(
    world: World,
    patients: int,
    seed: int,
    row_group_size: int,
) -> Iterator[pa.Table]:
    split_names = np.asarray(SPLITS, dtype=object)[split_patients(patients, seed)]
    width = max(7, len(str(patients - 1)))  # ids do not depend on the cohort size
    columns = {name: [] for name in VISITS_SCHEMA.names}
    for i in range(patients):
        pid = f"P{i:0{width}d}"
        for seq, (diag, proc, meds) in enumerate(_patient(world, _patient_rng(seed, i))):
            codes = [MEDICATIONS[m] for m in meds]
            row = (pid, f"{pid}-{seq}", seq, diag, proc, codes, split_names[i])
            for name, value in zip(VISITS_SCHEMA.names, row, strict=True):
                columns[name].append(value)
        if len(columns["visit_id"]) >= row_group_size or i == patients - 1:
            yield pa.table(columns, schema=VISITS_SCHEMA)
            columns = {name: [] for name in VISITS_SCHEMA.names}


def generate(
    out_dir: str | os.PathLike,
    patients: int = 6350,
    seed: int = 0,
    row_group_size: int = DEFAULT_ROW_GROUP,
) -> Path:
    """Write a synthetic dataset (`visits.parquet` with a split column, `ddi.parquet`).

    Deterministic for (patients, seed). Row groups hold whole patients: `row_group_size`
    visits or a few more each. Returns the dataset directory.
    """
    if patients < 1:
        raise ValueError("patients must be at least 1")
    if seed < 0:
        raise ValueError("seed must be non-negative")
    out = Path(out_dir)
    world = build_world(seed)
    ddi = _choose_ddi(world, seed)
    world = with_ddi(world, ddi)
    write_ddi(out / DDI_FILE, [(MEDICATIONS[a], MEDICATIONS[b]) for a, b in ddi])
    write_visits(
        out / VISITS_FILE, _batches(world, patients, seed, row_group_size), row_group_size=None
    )
    return out
