"""cognet.training: `cognet train`'s library side.

`train` (the loop, early stopping, the checkpoint), `tuning` (choices made on the
validation split: the averaged weights, the set decoding's threshold and rule) and
`ddi_target` (a DDI policy and threshold chosen on validation for a DDI-rate target).
"""
