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

Defaults reproduce the paper's statistics (issue 2, point 6) at 6,350 patients. Patients are
generated one by one from their own seeded random stream (patient i is the same whatever the
cohort size) and written in row groups of whole patients, so memory stays bounded for any N
(about 300 MB and 65 CPU seconds per million visits). `visits.parquet` carries a `split`
column, `cognet.core.schema.split_patients(N, seed)`: what `read_dataset(split_seed=seed)` would
draw for a file without one.
"""

from __future__ import annotations

import bisect
import functools
import math
import operator
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa

from cognet.core.schema import (
    DDI_FILE,
    SPLITS,
    VISITS_FILE,
    VISITS_SCHEMA,
    split_patients,
    write_ddi,
    write_visits,
)

# -- vocabularies ------------------------------------------------------------------------------

# 131 ATC-3 codes (letter, two digits, letter), commonest first: the first N_WARD are ward
# medications given at most visits, the others fill condition slots.
MEDICATIONS = tuple(
    "N02B A12C A06A B05C A02B B01A A01A N02A A12B C07A "
    "C03C J01D N05C C10A A12A N05B J01X B03A A10A C09A N05A N03A C01D C08C J05A R03A H02A "
    "A04A J01M C01B A07A R03B V03A H03A M03B N06A C02D A11C J01C A03F B05B C01C B02B N07B "
    "C09C J01E L04A D01A R06A A11D S01A J02A N01A C03A A10B G04C N04B J01F D07A M01A C02A "
    "A07E L01A H01C S01E R05C A03A B03B J01G C05A N01B D06B G04B A07D L01B M04A C08D J04A "
    "A09A P01A C04A R01A S01B D08A M05B L02B B02A G03A J01A N06B H05B C03D R03D B03X A11G "
    "D06A S01X A16A N04A L03A G03C H01B N07A D04A A05A C01E M03A R05D L01X V06D D10A J06B "
    "G01A S02A H03B A08A R03C D11A P01B G03D C02C A14A V04C D05A B06A L02A N02C A07B G02C "
    "C05B R02A".split()
)
N_WARD = 10
# Real ICD-9 codes give the commonest latent pieces a familiar look; the rest are random
# codes of the same shapes.
CHRONIC_DIAG = tuple(
    "428.0 427.31 250.00 585.9 496 401.9 414.01 571.5 272.4 403.90 425.4 "
    "493.20 294.10 332.0 340".split()
)
ACUTE_DIAG = tuple(
    "486 584.9 038.9 599.0 518.81 410.71 431 577.0 995.92 507.0 785.52 578.9 "
    "276.2 286.9 434.11".split()
)
COMORBIDITY_DIAG = tuple(
    "V45.81 V58.61 305.1 E878.8 V10.3 V15.82 E849.7 V58.67 V43.3 278.00".split()
)
SEVERITY_DIAG = tuple("799.02 458.9 780.97 785.59 348.30 570".split())
SEVERITY_PROC = tuple("96.71 38.93 96.04 96.6 99.04 38.91 96.72 33.24 99.15 00.17".split())
COMMON_PROC = tuple(
    "39.61 39.95 36.15 88.56 45.13 37.22 00.14 99.07 88.72 54.91 36.07 37.23 "
    "86.04 34.91 44.43".split()
)

# -- knobs (tuned against the targets of issue 2, point 6) --------------------------------------

N_CHRONIC, N_ACUTE = 48, 220
N_DIAG_POOL, N_PROC_POOL = 2000, 1700  # distinct codes that can appear (about 75% do at 6,350)
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
# Zipf (exponent, offset) of the slot medications of (acute, chronic) conditions: chronic
# drugs spread wider, so that few of them can be guessed from their popularity alone
SLOT_ZIPF = ((2.25, 5.0), (1.5, 20.0))
WARD_IN_SLOTS = 0.12  # slot weight of a ward medication, relative to the top slot one
N_SITES, SITE_CONCENTRATION = 3, 1.0  # hospitals: each weighs slot alternatives its own way
N_COMORBID, P_COMORBID = 4, 0.9  # patient-level codes and their per-visit emission
NOISE_DIAG, NOISE_PROC = 0.1, 0.5  # mean unrelated codes per visit (gamma-Poisson)
MAX_DIAG, MAX_PROC, MAX_MEDS = 39, 32, 53
# Share of a pilot cohort's co-prescribed pairs that the DDI pairs cover; avoidance then
# brings the ground-truth DDI rate of the data down to about 0.09.
N_DDI, DDI_SHARE = 448, 0.101
N_PILOT = 1500
DEFAULT_ROW_GROUP = 65536


@dataclass(frozen=True)
class _Condition:
    chronic: bool
    core: tuple[str, ...]
    secondary: tuple[str, ...]
    p_secondary: float
    procedures: tuple[tuple[str, float], ...]
    # per slot: alternative medication ids, their weights per site, and the bit mask of the
    # medications any alternative interacts with
    slots: tuple[tuple[tuple[int, ...], tuple[tuple[float, ...], ...], int], ...]


@dataclass(frozen=True)
class _World:
    conditions: tuple[_Condition, ...]
    chronic_cum: tuple[float, ...]  # cumulative onset weights over chronic condition ids
    acute_cum: tuple[float, ...]
    n_chronic: int
    ward_p: tuple[tuple[float, ...], ...]  # per site, per ward medication
    comorbid: tuple[str, ...]
    comorbid_cum: tuple[float, ...]
    noise_diag: tuple[str, ...]
    noise_diag_cum: tuple[float, ...]
    noise_proc: tuple[str, ...]
    noise_proc_cum: tuple[float, ...]
    interacts: tuple[int, ...] = ()  # per medication id: bit mask of the ids it interacts with


# -- the world -------------------------------------------------------------------------------


def _codes(rng: np.random.Generator, n: int, make, seen: set[str]) -> list[str]:
    out = []
    while len(out) < n:
        code = make(rng)
        if code not in seen:
            seen.add(code)
            out.append(code)
    return out


def _diag_code(rng: np.random.Generator) -> str:
    kind = rng.random()
    if kind < 0.16:
        return f"V{rng.integers(1, 92):02d}.{rng.integers(0, 10)}{rng.integers(0, 10) or ''}"
    if kind < 0.22:
        return f"E{rng.integers(800, 1000)}.{rng.integers(0, 10)}"
    if kind < 0.3:
        return f"{rng.integers(1, 1000):03d}"
    return f"{rng.integers(1, 1000):03d}.{rng.integers(0, 10)}{rng.integers(0, 10) or ''}"


def _proc_code(rng: np.random.Generator) -> str:
    if rng.random() < 0.25:
        return f"{rng.integers(0, 100):02d}.{rng.integers(0, 10)}"
    return f"{rng.integers(0, 100):02d}.{rng.integers(0, 100):02d}"


def _zipf_cum(n: int, exponent: float, offset: float = 1.0) -> tuple[float, ...]:
    return tuple(np.cumsum((np.arange(n) + offset) ** -exponent).tolist())


def _slot_weights(skew: float, offset: float) -> np.ndarray:
    """Chance of each medication to be a slot alternative: Zipf over the non-ward ones, each
    ward medication weighing WARD_IN_SLOTS of the top one."""
    weight = (np.arange(len(MEDICATIONS) - N_WARD) + offset) ** -skew
    weight = np.concatenate([np.full(N_WARD, WARD_IN_SLOTS * weight[0]), weight])
    return weight / weight.sum()


def _build_world(seed: int) -> _World:
    rng = np.random.default_rng([seed, 1])
    seen: set[str] = set(CHRONIC_DIAG + ACUTE_DIAG + COMORBIDITY_DIAG + SEVERITY_DIAG)
    diag_pool = _codes(rng, N_DIAG_POOL, _diag_code, seen)
    seen = set(SEVERITY_PROC + COMMON_PROC)
    proc_pool = list(COMMON_PROC) + _codes(rng, N_PROC_POOL, _proc_code, seen)
    diag_iter = iter(diag_pool)

    med_weight = [_slot_weights(*SLOT_ZIPF[kind]) for kind in (0, 1)]  # acute, chronic
    conditions = []
    for c in range(N_CHRONIC + N_ACUTE):
        chronic = c < N_CHRONIC
        named = CHRONIC_DIAG if chronic else ACUTE_DIAG
        rank = c if chronic else c - N_CHRONIC
        core = [named[rank]] if rank < len(named) else [next(diag_iter)]
        if rng.random() < 0.4:
            core.append(next(diag_iter))
        secondary = tuple(next(diag_iter) for _ in range(rng.integers(2, 7)))
        n_proc = rng.integers(0, 2) if chronic else rng.integers(0, 4)
        picks = rng.choice(len(proc_pool) // 2, size=n_proc, replace=False)
        procedures = tuple((proc_pool[i], float(rng.uniform(0.1, 0.5))) for i in picks)
        slots = []
        for _ in range(rng.integers(2, 6) if chronic else rng.integers(2, 6)):
            n_alts = rng.integers(3, 6) if chronic else rng.integers(2, 4)
            alts = rng.choice(len(MEDICATIONS), size=n_alts, replace=False, p=med_weight[chronic])
            site_weights = rng.dirichlet(np.full(n_alts, SITE_CONCENTRATION), size=N_SITES)
            site_weights = tuple(tuple(w.tolist()) for w in site_weights)
            slots.append((tuple(int(a) for a in alts), site_weights, 0))
        conditions.append(
            _Condition(
                chronic,
                tuple(core),
                secondary,
                float(rng.uniform(0.05, 0.2)),
                procedures,
                tuple(slots),
            )
        )
    _cover_all_medications(rng, conditions)

    ward = np.linspace(0.9, 0.68, N_WARD)
    used = {code for cond in conditions for code in cond.core + cond.secondary}
    noise_diag = [code for code in diag_pool if code not in used]
    rng.shuffle(noise_diag)
    noise_proc = proc_pool[len(proc_pool) // 4 :]
    rng.shuffle(noise_proc)
    comorbid = list(COMORBIDITY_DIAG) + noise_diag[:30]
    return _World(
        conditions=tuple(conditions),
        chronic_cum=_zipf_cum(N_CHRONIC, 1.0, 2.0),
        acute_cum=_zipf_cum(N_ACUTE, 0.9, 2.0),
        n_chronic=N_CHRONIC,
        ward_p=tuple(
            tuple((ward * np.where(np.arange(N_WARD) == skip, 0.2, 1.0)).tolist())
            for skip in rng.choice(N_WARD, size=N_SITES, replace=False)
        ),
        comorbid=tuple(comorbid),
        comorbid_cum=_zipf_cum(len(comorbid), 1.0),
        noise_diag=tuple(noise_diag[30:]),
        noise_diag_cum=_zipf_cum(len(noise_diag) - 30, 0.95, 5.0),
        noise_proc=tuple(noise_proc),
        noise_proc_cum=_zipf_cum(len(noise_proc), 0.9, 5.0),
    )


def _cover_all_medications(rng: np.random.Generator, conditions: list[_Condition]) -> None:
    """Add every slot medication no condition uses as an alternative of a random acute slot."""
    used = {m for cond in conditions for alts, _, _ in cond.slots for m in alts}
    for med in range(N_WARD, len(MEDICATIONS)):
        if med in used:
            continue
        c = int(rng.integers(N_CHRONIC, len(conditions)))
        cond = conditions[c]
        alts, site_weights, _ = cond.slots[-1]
        slot = (alts + (med,), tuple(w + (0.25,) for w in site_weights), 0)
        conditions[c] = replace(cond, slots=cond.slots[:-1] + (slot,))


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


_TAIL_CUM = _zipf_cum(MAX_VISITS - 2, VISITS_TAIL)  # 3..MAX_VISITS visits
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


def _patient(world: _World, rng: random.Random) -> list[tuple[list, list, list]]:
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
    world: _World,
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


def _choose_ddi(world: _World, seed: int) -> list[tuple[int, int]]:
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


def _with_ddi(world: _World, pairs: list[tuple[int, int]]) -> _World:
    """The world with its interaction masks filled in, per medication and per slot."""
    interacts = [0] * len(MEDICATIONS)
    for a, b in pairs:
        interacts[a] |= 1 << b
        interacts[b] |= 1 << a

    def partners(alts: tuple[int, ...]) -> int:
        return functools.reduce(operator.or_, (interacts[a] for a in alts), 0)

    conditions = tuple(
        replace(cond, slots=tuple((a, w, partners(a)) for a, w, _ in cond.slots))
        for cond in world.conditions
    )
    return replace(world, conditions=conditions, interacts=tuple(interacts))


# -- writing --------------------------------------------------------------------------------


def _batches(
    world: _World,
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
    world = _build_world(seed)
    ddi = _choose_ddi(world, seed)
    world = _with_ddi(world, ddi)
    write_ddi(out / DDI_FILE, [(MEDICATIONS[a], MEDICATIONS[b]) for a, b in ddi])
    write_visits(
        out / VISITS_FILE, _batches(world, patients, seed, row_group_size), row_group_size=None
    )
    return out
