"""Ready-made set-ups for training frameworks built on Paddle (PaddleFormers' Trainer)."""
