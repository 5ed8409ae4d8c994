"""Decoding defaults shared by the torch reference, the exporter and the runtime (torch-free).

The paper's decoding is beam search with beam 4 and at most 45 medications (DESIGN.md §3,
the rules: docs/INTERNALS.md "Beam search"). An exported model records BEAM and MAX_LEN in
its manifest; the runtime reads them from there.

DECODINGS names every decoding a caller may ask for (`ScoreOptions.decoding`,
`cognet.runtime.options`); adding one starts here, with its implementation beside the beam
search.
"""

BEAM = 4  # beam width; 1 = greedy
MAX_LEN = 45  # decoder steps at most (medications + END)
DECODINGS = ("beam",)
DEFAULT_DECODING = "beam"
