"""The graphed block: its capture, its graphs, replay through the autograd bridge, verification."""
