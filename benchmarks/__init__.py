"""cognet.benchmarks: `cognet-bench`, cognet's inference engines measured side by side.

`engines` (the engines behind one interface), `perpatient` (the paper-style baseline),
`workload` (the visits and batches), `settings` (what a run measures), `harness` (the
measurement loop and the past-visits series) with `interleaved_runs` (one block of it),
`latency` (requests of N visits as a user meets them), `guard` (the correctness guard),
`agreement` and `estimators` (the runtime against torch, set decoding's estimators),
`machine_info` (/proc, memory, machine description), `score_subprocess` (cognet-batch in a
subprocess: the input-size series), `omop_convert` (`cognet data omop`'s time and memory),
`profile` (where ort-cpu's time goes), `report` (results.md, throughput.png and
latency.png), `cli` (the command). See BENCHMARKS.md for the method.
"""
