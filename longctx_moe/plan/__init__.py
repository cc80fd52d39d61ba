"""`longctx-moe plan`: which parallel layout to run a model on N GPUs with, ranked by modeled step
time among those whose per-rank memory fits.

    layouts.py   every layout the configuration accepts (build.check_layout's rules judge each)
    memory.py    per-rank memory by category, measured from the program on meta (cached on disk)
    timing.py    modeled step time: compute (data_packing.balance.token_pair_cost's a*tokens +
                 b*pairs at per-GPU efficiencies), exposed communication, replica imbalance
    cli.py       the command
"""
