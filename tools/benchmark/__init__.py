"""The pieces of tools/bench.py: configs, timing, the Paddle runs, the torch runs, the report.

Nothing here imports Paddle or torch at module level: the torch runs happen in a child process
that must never load Paddle's libraries, and the Paddle runs never load torch.
"""
