"""cognet.benchmarks: `cognet-bench`, cognet's inference engines measured side by side.

`engines` (the engines behind one interface), `perpatient` (the paper-style baseline),
`workload` (the visits and batches), `harness` (timing, memory, the correctness guard, the
scaling series), `profile` (where ort-cpu's time goes), `report` (results.md and
throughput.png), `cli` (the command). See BENCHMARKS.md for the method.
"""
