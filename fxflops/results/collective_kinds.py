"""The kinds of collective a rank calls (Collective.op), apart from the records: what reads collective nodes out of
every captured graph (`fxflops.parallel.collectives`) needs them, and the records only where a graph holds one."""

ALL_REDUCE = "all_reduce"
ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
ALL_TO_ALL = "all_to_all"
BROADCAST = "broadcast"
REDUCE = "reduce"
GATHER = "gather"
SCATTER = "scatter"
SEND = "send"
RECV = "recv"
BARRIER = "barrier"
