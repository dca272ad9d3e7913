"""Chains: consecutive graphed calls, each given the previous one's output, replayed through one
autograd bridge (NOTE [ Chains of graphed calls ] in chains/chain.py)."""
