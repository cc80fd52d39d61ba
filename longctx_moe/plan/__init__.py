"""`longctx-moe plan`: which parallel layout to run a model on N GPUs with, ranked by modeled step
time among those whose per-rank memory fits.

    layouts.py   every layout the configuration accepts (build.check_layout judges each)
    memory.py    per-rank memory by category, measured from the program on meta (cached on disk)
    timing.py    modeled step time: compute, exposed communication
    cli.py       the command
"""
