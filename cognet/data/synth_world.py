"""The latent world of the synthetic datasets (`cognet.data.synth`): codes, conditions, sites,
and the knobs tuned so that the data has the paper's statistics.

A world is drawn once per seed (`build_world`) and then drives every patient; `with_ddi`
fills in which medications interact once the DDI pairs are chosen.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, replace

import numpy as np

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

# -- knobs of the world (tuned against the paper's dataset statistics; the patients' knobs
# are in `cognet.data.synth`) -----------------------------------------------------------------

N_CHRONIC, N_ACUTE = 48, 220
N_DIAG_POOL, N_PROC_POOL = 2000, 1700  # distinct codes that can appear (about 75% do at 6,350)
# Zipf (exponent, offset) of the slot medications of (acute, chronic) conditions: chronic
# drugs spread wider, so that few of them can be guessed from their popularity alone
SLOT_ZIPF = ((2.25, 5.0), (1.5, 20.0))
WARD_IN_SLOTS = 0.12  # slot weight of a ward medication, relative to the top slot one
N_SITES, SITE_CONCENTRATION = 3, 1.0  # hospitals: each weighs slot alternatives its own way


@dataclass(frozen=True)
class Condition:
    chronic: bool
    core: tuple[str, ...]
    secondary: tuple[str, ...]
    p_secondary: float
    procedures: tuple[tuple[str, float], ...]
    # per slot: alternative medication ids, their weights per site, and the bit mask of the
    # medications any alternative interacts with
    slots: tuple[tuple[tuple[int, ...], tuple[tuple[float, ...], ...], int], ...]


@dataclass(frozen=True)
class World:
    conditions: tuple[Condition, ...]
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


def zipf_cum(n: int, exponent: float, offset: float = 1.0) -> tuple[float, ...]:
    return tuple(np.cumsum((np.arange(n) + offset) ** -exponent).tolist())


def _slot_weights(skew: float, offset: float) -> np.ndarray:
    """Chance of each medication to be a slot alternative: Zipf over the non-ward ones, each
    ward medication weighing WARD_IN_SLOTS of the top one."""
    weight = (np.arange(len(MEDICATIONS) - N_WARD) + offset) ** -skew
    weight = np.concatenate([np.full(N_WARD, WARD_IN_SLOTS * weight[0]), weight])
    return weight / weight.sum()


def build_world(seed: int) -> World:
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
        for _ in range(rng.integers(2, 6)):
            n_alts = rng.integers(3, 6) if chronic else rng.integers(2, 4)
            alts = rng.choice(len(MEDICATIONS), size=n_alts, replace=False, p=med_weight[chronic])
            site_weights = rng.dirichlet(np.full(n_alts, SITE_CONCENTRATION), size=N_SITES)
            site_weights = tuple(tuple(w.tolist()) for w in site_weights)
            slots.append((tuple(int(a) for a in alts), site_weights, 0))
        conditions.append(
            Condition(
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
    return World(
        conditions=tuple(conditions),
        chronic_cum=zipf_cum(N_CHRONIC, 1.0, 2.0),
        acute_cum=zipf_cum(N_ACUTE, 0.9, 2.0),
        n_chronic=N_CHRONIC,
        ward_p=tuple(
            tuple((ward * np.where(np.arange(N_WARD) == skip, 0.2, 1.0)).tolist())
            for skip in rng.choice(N_WARD, size=N_SITES, replace=False)
        ),
        comorbid=tuple(comorbid),
        comorbid_cum=zipf_cum(len(comorbid), 1.0),
        noise_diag=tuple(noise_diag[30:]),
        noise_diag_cum=zipf_cum(len(noise_diag) - 30, 0.95, 5.0),
        noise_proc=tuple(noise_proc),
        noise_proc_cum=zipf_cum(len(noise_proc), 0.9, 5.0),
    )


def _cover_all_medications(rng: np.random.Generator, conditions: list[Condition]) -> None:
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


def with_ddi(world: World, pairs: list[tuple[int, int]]) -> World:
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
