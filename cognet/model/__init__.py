"""cognet.model: the COGNet network in torch and what serves it to training and evaluation.

`network` (the model, its config and its graph inputs), `ensemble` (networks trained
apart, decoded as one model), `set_head` (the one-pass network of the marginal decoding),
`batching` (visits -> padded tensors), `checkpoint` (save, load) with `checkpoint_checks`
(what loading verifies), `session` (the torch decoder session of the decoding driver) and
`torch_decoding` (beam search, set decoding and the marginal decoding over whole batches).
Modules import torch; this file does not.
"""
