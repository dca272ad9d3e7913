"""What goes in and out of a graph: argument trees, static input buffers, host tensors, stale outputs."""
