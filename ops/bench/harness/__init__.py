"""What every benchmark needs and none should write again.

- `stats`: nearest-rank percentiles, median/min/max spreads, Latin rotations, the block bootstrap;
- `machine`: the host's load average, memory available and uptime, recorded beside the figures;
- `procs`: CPU time of child processes, stopping a process group, scanning child logs, waiting
  for workers to register;
- `tenants`: tenants and API keys made straight in Redis for a run;
- `loops`: in-process engine loops (closed loop, decode-only timing, stepping arms in turn, prefill);
- `prompts`: the synthetic and chat-templated prompts the engine benchmarks share;
- `engines`: the in-process engine benchmarks' `--model`, `--dtype`, `--kv-format` and the engine they build;
- `progress`: progress lines on stderr (the table goes to stdout);
- `plot`: matplotlib when installed, a PNG beside the JSON.

Child processes and waiting for HTTP are `ops.cluster`'s (`child_process`, `wait_http`, `Service`), as
is `machine_info`; the JSON report is `ops.bench.report`'s.
"""
