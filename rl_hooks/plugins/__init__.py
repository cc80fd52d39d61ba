"""Framework plugins: longctx-moe inside an RL framework's own worker.

    verl/   a verl training engine registered in verl's EngineRegistry (`strategy: longctx_moe`)

Each plugin imports its framework; nothing else in rl_hooks does (the adapters in
rl_hooks/adapters convert layouts without importing any framework).
"""
