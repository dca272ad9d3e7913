"""Gradients of a graphed block: handles and aliases, the hand-out plan, grad stacks, the hook registry, in-graph accumulation."""
