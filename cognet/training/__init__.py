"""cognet.training: `cognet train`'s library side.

`train` (the configuration, the loop, early stopping), `loss` (the training losses),
`tuning` (choices made on the validation split: the averaged weights, the set decoding's
threshold and rule), `members` (the end of a run: the decoding tuned, the set head
trained, the checkpoint written; ensembles of runs), `set_head` (the head learnt from the
members' own P(k in S)) and `ddi_target` (a DDI policy and set rule chosen on validation
for a DDI-rate target).
"""
