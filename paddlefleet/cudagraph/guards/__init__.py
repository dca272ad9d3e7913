"""What a capture intercepts: guards on host access, random draws, in-place writes, Layer attributes,
value-dependent shapes, the op trace, and the one way a Paddle attribute is replaced (paddle_patches)."""
