"""The phase machine and what every body shares: keys, calls, counters, the Layers and state a capture sees."""
