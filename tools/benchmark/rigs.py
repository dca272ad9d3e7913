"""The benchmark's block models as the probes run them: one runner's model, eager or with each
block graphed, its parameters and data, a snapshot of one step to compare runners bit for bit."""

from .paddle_runs import Blocks
from paddlefleet.cudagraph import autocudagraph
from testkit.common import build


class BlockRig:
    """One runner's model of ``cfg`` (the same parameters for every rig), on ``x`` with output grad ``dy``; with
    ``graphed``, each block wrapped by ``autocudagraph(block, backend=backend, **options)``."""

    def __init__(self, cfg, backend, x, dy, graphed, **options):
        self.model = build(lambda: Blocks(cfg), 1)
        self.params = self.model.parameters()
        self.x, self.dy = x, dy
        self.graphed = graphed
        if graphed:
            for block in self.model.blocks:
                autocudagraph(block, backend=backend, **options)

    def release(self):
        for p in self.params:
            p.clear_gradient(False)

    def snapshot(self):
        """[output, every parameter's grad] of one step, as numpy; the grads released after."""
        y = self.model(self.x)
        y.backward(self.dy)
        out = [y.numpy()] + [p.grad.numpy() for p in self.params]
        self.release()
        return out
