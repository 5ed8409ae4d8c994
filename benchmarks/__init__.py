"""cognet.benchmarks: `cognet-bench`, cognet's inference engines measured side by side.

`engines` (the engines behind one interface), `perpatient` (the paper-style baseline),
`workload` (the visits and batches), `settings` (what a run measures), `harness` (the
measurement loop and the past-visits series), `guard` (the correctness guard), `machine_info`
(/proc, memory, machine description), `score_subprocess` (cognet-batch in a subprocess: the
input-size series), `profile` (where ort-cpu's time goes), `report`
(results.md and throughput.png), `cli` (the command). See BENCHMARKS.md for the method.
"""
