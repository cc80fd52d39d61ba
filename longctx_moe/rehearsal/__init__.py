"""Cluster rehearsal (prototype): one rank of an N-rank job run in this process, on storage-less
`meta` tensors under torch's `fake` process group.

    fake_world.py  the fake group, the rank's ParallelDims and parallelized meta model, a meta
                   micro-batch, one step that reports where the program first fails
    standins.py    the stand-ins that carry a step past each known failure (what a seam of the
                   program must provide instead; /work/notes/rehearsal_findings.md lists them)
"""
