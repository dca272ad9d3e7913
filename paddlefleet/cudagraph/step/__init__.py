"""The whole training step as one graph: its body, optimizer state, grad slots, host reads, rollback, the grad scaler."""
