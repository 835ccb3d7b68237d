"""An interleaved pipeline whose layers do not split evenly into its chunks: the deeper chunk is in flight as often as
the shallower one or more, so a rank holds more layer-micro-batches than its in-flight chunks times its average chunk
depth; the memory per rank counts each in-flight chunk by its own layers."""

from __future__ import annotations

import warnings

import torch

import fxflops
from tests.test_predict_memory import LAYER_SAVED, TinyGPT


def test_uneven_interleaved_chunks_hold_each_chunks_own_layers() -> None:
    # 6 layers in 2 stages x 2 virtual stages: chunks of 2, 2, 1 and 1 layers, each rank holds a chunk of 2 and one
    # of 1. Rank 1's 1F1B: the forwards of micro-batches 0 and 1 on its deep chunk (4 layer-micro-batches), then
    # micro-batch 0 on its shallow chunk, and its backward, then micro-batch 2 on the deep chunk: 6 at once (read
    # from the simulated schedule's own events below), where 3 chunks in flight x 1.5 layers read 4.5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = fxflops.predict_step(TinyGPT(6), (torch.zeros(2, 32, dtype=torch.long),),
                                    parallel={"pp": 2, "virtual_stages": 2}, cluster="DGX A100 80GB",
                                    dtype=torch.float32, global_batch=8, optimizer_state_bytes=8)
    depth = [2, 2, 1, 1]
    for rank, memory in enumerate(step.memory):
        marks = sorted(((e.start, depth[e.chunk]) if e.kind == "forward" else (e.end, -depth[e.chunk]))
                       for e in step.timeline.rank_events(rank) if e.stream == "compute")
        live = most = 0
        for _, change in marks:
            live += change
            most = max(most, live)
        assert most == (9 if rank == 0 else 6)
        # whatever the moment, every micro-batch chunk in flight but the running one (at most 2 layers) is held
        assert memory.by_kind["activations"] >= (most - 2) * LAYER_SAVED
