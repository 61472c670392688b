"""One worker as a group of ranks on `torch.distributed` (gloo on CPU, NCCL on GPUs).

- `sharding.py`: which slice of each checkpoint tensor a rank reads (tensor, vocab and
  expert parallelism) and the rank's local view of the config.
- `weight_slices.py`: a rank's rows or columns of one stored linear in each weight format
  (FP8 block scales, INT4 groups), read without the rest.
- `collectives.py`: the all-reduce / gather / broadcast calls the model makes, counted,
  with failures turned into `GroupFailure`.
- `step_broadcast.py`: rank 0 sends each step's input ids and batch metadata to the others.
- `kv_exchange.py`: a prefill/decode KV transfer through rank 0 (it gathers and scatters the
  ranks' KV heads, so the wire carries whole layers whatever either side's group size).
- `group.py`: starting a group (spawned by the worker, or under `torchrun`), the followers'
  loop, and the watchdog that ends the group when a rank dies.
- `kernel_choices.py`: the CPU kernel choices a process times for itself, made by rank 0 for
  the whole group.

Nothing here is imported by a single-process worker: at world size 1 the model makes no
collective call at all.
"""
