"""Parallel jobs: what one rank of a sharded model runs, and what it sends.

`collectives` reads the collective calls out of a captured graph (records with group, payload and wire
bytes). `plan` is a plan as data, checked against the model; `whatif` (what-if plans: a fake mesh,
torch's own parallelize_module / fully_shard / replicate, one capture per plan) imports torch.distributed;
`buckets` turns DDP's per-unit gradient all-reduces into DDP's bucket all-reduces;
`pipeline` cuts that capture into pipeline stages (one estimate per distinct pipeline rank, the send/recv
of what crosses each cut) and `replicated` finds the work every tp rank repeats; `stage` counts a
torch.distributed.pipelining PipelineStage, and `schedule` one step of a pipelining schedule (the send/recv
torch's schedule issues, recorded on fake tensors). estimate() imports `collectives`, `stage` and `schedule`
only, and none imports torch.distributed.
"""
