"""cognet.model: the COGNet network in torch and what serves it to training and evaluation.

`network` (the model, its config and its graph inputs), `batching` (visits -> padded
tensors), `checkpoint` (save, load) with `checkpoint_checks` (what loading verifies),
`session` (the torch decoder session of the decoding driver) and `decoding` (beam search
and set decoding over whole batches). Modules import torch; this file does not.
"""
