"""paddlefleet: PaddlePaddle-native training extensions."""

__version__ = "0.1.0"
