"""Parallel jobs: what one rank of a sharded model runs, and what it sends.

`collectives` reads the collective calls out of a captured graph (records with group, payload and wire
bytes). `plan` (what-if plans: a fake mesh, torch's own parallelize_module / fully_shard, one capture per
rank role) imports torch.distributed; nothing here is imported by `import fxflops`.
"""
