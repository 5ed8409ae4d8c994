"""cognet.core: the torch-free pieces that training, export and the runtime all import.

- data in: the dataset contract (`schema`), vocabularies (`vocab`), history assembly
  (`history`), the set head's inputs (`head_inputs`), ragged id lists (`ragged`), ATC codes
  (`atc`) and the names shown beside codes (`code_names`);
- models: the model-directory format (`manifest`, its graph entries `manifest_graphs`),
  graph I/O names (`graphspec`), the JSON schemas of checkpoints and model directories
  (`schemas`, written in the field language of `fields`), TensorRT options (`tensorrt`);
- decoding: every decoding, its loop and its rules (the `decoding` package), DDI policies
  and targets (`ddi`), metrics (`metrics`);
- running: errors (`InputError`), strict numbers and JSON (`strict_json`), atomic writes and
  output checks (`files`), outputs that are no regular file (`sinks`), the one-writer lock
  (`lock`), signals as exceptions (`interrupt`), progress bars (`progress`) and what the
  command lines share (`commandline`).

Nothing here imports torch nor any cognet module outside `cognet.core` (`make lint` checks
it), so a scoring box installs the runtime without torch.
"""
