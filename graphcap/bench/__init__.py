"""`graphcap bench` and the benchmarks' shared parts, one concept per module:

- `options`: the bench's arguments and `BenchConfig`; `runner`: the measuring loop; `report`: table and files;
  `rows`: the typed records;
- `baselines`, `sglang_ops`: the modes graphcap is measured against (sglang's kernels as it drives them);
- `timing`: the one timer; `counting`: syncs and kernels per call; `environment`: the one environment report;
- `roofline`: the bandwidth floor; `gpu_monitor`: NVML sampling; `state`: random target-engine state.

graphcap's library modules import nothing here; the command line does: graphcap/cli.py imports `options` at
module level (the bench's arguments are part of the one parser tree) and `runner` lazily, when `bench` runs.
"""
