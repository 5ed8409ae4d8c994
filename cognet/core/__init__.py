"""cognet.core: the torch-free pieces that training, export and the runtime all import.

errors (`InputError`), the dataset contract (`schema`), vocabularies (`vocab`), history
assembly (`history`), the model-directory format (`manifest`) and graph I/O names
(`graphspec`), DDI policies (`ddi`), metrics (`metrics`), decoding defaults and the --beam
rule (`decoding`), the one decoding loop (`driver`) and set decoding's sampler (`sampling`),
TensorRT provider options (`tensorrt`), progress bars (`progress`), the atomic
writes and checks of outputs (`files`) and the one-writer lock of outputs (`lock`).

Nothing here imports torch nor any cognet module outside `cognet.core` (`make lint` checks
it), so a scoring box installs the runtime without torch.
"""
