"""cognet.evaluation: `cognet evaluate`'s library side.

`evaluate` (a checkpoint or a baseline on one split, DESIGN.md §4) with its `options`
(`EvalOptions`, torch-free), `baselines` (copy-last, frequent, logistic regression) and
`ddi_tradeoff` (Jaccard against DDI rate over the DDI policies).
"""
