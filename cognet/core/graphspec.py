"""Names and order of the inputs and outputs of the three model graphs (torch-free).

Defined once and shared by the torch model (`cognet.model.network`), the exporter and the runtime.
Shapes: N visits, B beams, H heads, dh = dim / H, T generated positions, Ld / Lp / Lm code
lengths, J history visits, S history medication slots, V1 = medications + END.
"""

ENCODER_INPUTS = ("diagnoses", "procedures", "medications")  # int64 [N, L*], padded with PAD ids
ENCODER_OUTPUTS = (
    "diag_enc",  # [N, Ld, s]
    "proc_enc",  # [N, Lp, s]
    "v_d",  # [N, s]
    "v_p",  # [N, s]
    "med_enc",  # [N, Lm, s]
)

# The encoder in three graphs, one per kind of code (`cognet-export` cuts them from the
# encoder graph: the same nodes). The three kinds are encoded independently, so the runtime
# can call each on rows grouped by that kind's length alone: one padded [N, L] call of all
# three pads every kind to the longest of its call. Absent in models exported before them.
ENCODER_PARTS = {
    "encoder_diag": (("diagnoses",), ("diag_enc", "v_d")),
    "encoder_proc": (("procedures",), ("proc_enc", "v_p")),
    "encoder_med": (("medications",), ("med_enc",)),
}

INIT_INPUTS = (
    "diag_enc",  # [N, Ld, s]
    "diag_mask",  # float [N, Ld], 1 = code, 0 = padding
    "proc_enc",  # [N, Lp, s]
    "proc_mask",  # float [N, Lp]
    "v_d",  # [N, s]
    "v_p",  # [N, s]
    "hist_v_d",  # [N, J, s]   visit vectors of the past visits
    "hist_v_p",  # [N, J, s]
    "hist_mask",  # float [N, J]
    "slot_enc",  # [N, S, s]   medication-set encodings of every past medication slot
    "slot_mask",  # float [N, S]
    "slot_visit",  # int64 [N, S] index j of the past visit holding the slot
    "slot_med",  # int64 [N, S] medication id of the slot
)

# The encoding inputs of the decoder init, gathered from the encoder outputs laid out in two
# flat buffers (`cognet.runtime.layout.Layout`): (input, buffer, rank of its row index).
INIT_GATHERED = (
    ("diag_enc", "codes", 2),
    ("proc_enc", "codes", 2),
    ("slot_enc", "codes", 2),
    ("v_d", "visits", 1),
    ("v_p", "visits", 1),
    ("hist_v_d", "visits", 2),
    ("hist_v_p", "visits", 2),
)

# Per-visit memories: outputs of the decoder init, inputs of every decoder step.
MEMORIES = (
    "cross_key_d",  # [N, H, dh, Ld]  keys, transposed and pre-scaled by 1/sqrt(dh)
    "cross_value_d",  # [N, H, Ld, dh]
    "cross_bias_d",  # [N, Ld]        0 for codes, NEG for padding
    "cross_flag_d",  # [N]            1 if the visit has a diagnosis (and D is used)
    "cross_key_p",  # [N, H, dh, Lp]
    "cross_value_p",  # [N, H, Lp, dh]
    "cross_bias_p",  # [N, Lp]
    "cross_flag_p",  # [N]
    "copy_key",  # [N, s, S]   slot encodings, transposed and pre-scaled by 1/sqrt(s)
    "copy_bias",  # [N, S]      log c_j of the slot's visit, NEG for padding
    "copy_onehot",  # [N, S, V1]  slot -> medication id
    "has_history",  # [N]         1 if the copy distribution is used
)
INIT_OUTPUTS = MEMORIES

# The step's self-attention cache: the tokens each row has been fed so far (its prefix). The
# decoder has one layer and no position embeddings, so a token's query, key and value depend
# on the token alone: the exported step looks them up in tables of every token (computed at
# export) instead of carrying keys and values from step to step (docs/DESIGN.md, "The
# decoder step's cache"). The torch model's own step keeps the KV cache (KV_CACHE_INPUTS),
# and so do the step graphs of models exported before.
STEP_CACHE_INPUTS = ("past_tokens",)  # int64 [N, B, T]
STEP_CACHE_OUTPUTS = ("present_tokens",)  # int64 [N, B, T + 1]
KV_CACHE_INPUTS = ("past_key", "past_value")  # [N, B, H, dh, T] and [N, B, H, T, dh]
KV_CACHE_OUTPUTS = ("present_key", "present_value")  # [N, B, H, dh, T + 1], [N, B, H, T + 1, dh]
STEP_INPUTS = ("tokens", "parent", *STEP_CACHE_INPUTS, *MEMORIES)  # tokens/parent int64 [N, B]
KV_STEP_INPUTS = ("tokens", "parent", *KV_CACHE_INPUTS, *MEMORIES)


def cache_shapes(n: int, beam: int, heads: int, head_dim: int, length: int = 0) -> tuple:
    """The shapes of KV_CACHE_INPUTS (past_key, past_value) after `length` steps; the
    first step's cache is empty (length 0)."""
    return (n, beam, heads, head_dim, length), (n, beam, heads, length, head_dim)


def step_feed(tokens, parent, cache, memories, cache_names=STEP_CACHE_INPUTS) -> dict:
    """A decoder step's inputs by name: tokens, parent, the cache (`cache_names`: the token
    prefix, or a KV cache) and the memories of the decoder init."""
    feed = dict(zip(("tokens", "parent", *cache_names), (tokens, parent, *cache), strict=True))
    feed.update(memories)
    return feed


STEP_HEADS = (
    "log_probs",  # [N, B, V1] log of the copy-or-predict mixture
    "gate",  # [N, B]     w_g, the weight of the generated distribution
    "copy_probs",  # [N, B, S]  copy distribution over the history slots
    "diag_attention",  # [N, H, B, Ld] diagnosis cross-attention weights (explanations)
)
STEP_OUTPUTS = (*STEP_HEADS, *STEP_CACHE_OUTPUTS)
KV_STEP_OUTPUTS = (*STEP_HEADS, *KV_CACHE_OUTPUTS)

# The search graphs of `cognet-export` (export/search_graphs.py), run by the runtime
# (`cognet.runtime.device_selectors`): their inputs, the outputs that come to the host each step and
# those that stay where the graphs run (the next step's state). N visits, B beams, S samples.
BEAM_SELECT_INPUTS = (
    "log_probs",  # float32 [N, B, V1]
    "scores",  # float32 [N, B]
    "used",  # bool [N, B, V1]
    "finished",  # bool [N, B]
)
BEAM_SELECT_HOST = (
    "scores_out",  # float32 [N, B]
    "parent_out",  # int64 [N, B]
    "token_out",  # int64 [N, B]
    "chosen_out",  # float32 [N, B] raw log-probability of the chosen token
    "live_out",  # bool [N, B] the beam was not finished before this step
    "finished_out",  # bool [N, B]
)
BEAM_SELECT_STATE = ("used_out",)  # bool [N, B, V1]
SET_SELECT_INPUTS = (
    "log_probs",  # float32 [N, S, V1]
    "used",  # bool [N, S, V1]
    "finished",  # bool [N, S]
    "uniforms",  # float64 [N, S] the step's draws (`cognet.core.decoding.draws.uniforms`)
    "hazard",  # float64 [N, M] running sums of the step probabilities
)
SET_SELECT_HOST = ("token_out", "finished_out")  # int64 / bool [N, S]
SET_SELECT_STATE = ("used_out", "hazard_out")  # bool [N, S, V1], float64 [N, M]
DDI_INPUTS = ("penalty", "hard")  # float32 [] and bool [] of the `_ddi` variants
# An ensemble's token-level mixture on the device (`mix_log_probs`, written for models of
# K >= 2 members): member i's log_probs float32 [N, B, V1] in, their mixture out (float32).
MIX_GRAPH = "mix_log_probs"
MIX_OUTPUT = "log_probs"


def mix_inputs(members: int) -> tuple[str, ...]:
    """The inputs of the mixture graph of `members` networks, in member order."""
    return tuple(f"log_probs_{i}" for i in range(members))


TAKE_INPUTS = ("x", "rows")  # [N, ...] and int64 [K]
TAKE_OUTPUT = "y"  # [K, ...]

# The take graphs of `cognet-export` (export/search_graphs.py): rows (axis 0) of a tensor of
# each element type and rank that the runtime gathers on a device (the KV cache has rank 5).
# ONNX wants a rank on every graph input and output, hence one graph per rank; the rank-2 one
# keeps the plain name `take_<dtype>`, which a model exported before gave its one rank-free
# take graph (the runtime runs that one for every rank: `take_graph_name` falls back to it).
TAKE_DTYPES = ("float32", "float16", "float64", "int64", "bool")
TAKE_RANKS = (1, 2, 3, 4, 5)


def take_graph_name(dtype: str, rank: int) -> str:
    """The take graph of a rank-`rank` tensor of `dtype` ("float32", ...)."""
    return f"take_{dtype}" if rank == 2 else f"take_{dtype}_{rank}d"


# Additive bias of padded attention positions: finite so fp16 and all-padding rows stay safe.
NEG = -1.0e4
# Floor of the mixture probability before the log.
PROB_FLOOR = 1.0e-20
