"""Does releasing a graphed model give its device memory back? (a probe)

    python tools/probes/release_probe.py

Each case runs in a function that returns before its memory is read (gc collected, the allocator's cache
released): a plain eager model (control), Paddle's own CUDAGraph of one matmul made and reset, and four
1024-wide matmul layers graphed one by one, trained 6 steps, then reset() or not, with chains or not.
Also: a graphed function under no_grad, layers graphed one by one called forward only, and
autocudagraph_step of the same forward + backward. It prints allocated / reserved MiB after each case and whether the case's model and parameters are still
alive (weak references).
"""

import argparse
import gc
import os
import sys
import weakref

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import numpy.random  # noqa: E402,F401
import paddle  # noqa: E402

from paddlefleet.cudagraph import autocudagraph  # noqa: E402
from testkit.common import MatMLP, build, device, host_tensor, normal  # noqa: E402

MIB = float(1 << 20)
REFS = []


def settled(what):
    gc.collect()
    paddle.device.cuda.synchronize()
    paddle.device.cuda.empty_cache()
    alive = sum(r() is not None for r in REFS)
    print(f"{what}: allocated {paddle.device.cuda.memory_allocated() / MIB:.1f} MiB, reserved "
          f"{paddle.device.cuda.memory_reserved() / MIB:.1f} MiB; {alive} of {len(REFS)} watched objects alive",
          flush=True)
    REFS.clear()


def train(graphed, reset, options, layers=4, width=1024):
    model = build(lambda: paddle.nn.Sequential(*[MatMLP([width, width]) for _ in range(layers)]), 1)
    REFS.extend([weakref.ref(model)] + [weakref.ref(p) for p in model.parameters()])
    if graphed:
        for layer in model:
            autocudagraph(layer, backend="cuda", warmup_steps=1, eager_if_slower=False, **options)
    draw = normal(1)
    x, dy = host_tensor(draw(8, width)), host_tensor(draw(8, width))
    for _ in range(6):
        model(x).backward(dy)
        for p in model.parameters():
            p.clear_gradient(False)
    if graphed and reset:
        for layer in model:
            layer.forward.reset()


def graphed_function(width=1024):
    """A graphed function of two matmuls, no autograd (no_grad): forward graphs only."""
    w = paddle.to_tensor(numpy.random.rand(width, width).astype("float32"))
    x = paddle.to_tensor(numpy.random.rand(8, width).astype("float32"))
    REFS.append(weakref.ref(w))
    f = autocudagraph(lambda x, w: paddle.matmul(paddle.matmul(x, w), w), backend="cuda", warmup_steps=1,
                      eager_if_slower=False)
    with paddle.no_grad():
        for _ in range(4):
            f(x, w)
    f.reset()


def forward_only(layers=4, width=1024):
    """Layers graphed one by one, called under no_grad only (forward graphs, no backward)."""
    model = build(lambda: paddle.nn.Sequential(*[MatMLP([width, width]) for _ in range(layers)]), 1)
    REFS.extend([weakref.ref(model)] + [weakref.ref(p) for p in model.parameters()])
    for layer in model:
        autocudagraph(layer, backend="cuda", warmup_steps=1, eager_if_slower=False)
    x = host_tensor(normal(1)(8, width))
    with paddle.no_grad():
        for _ in range(4):
            model(x)


def whole_step(layers=4, width=1024):
    """The same layers' forward + backward as one autocudagraph_step."""
    from paddlefleet.cudagraph import autocudagraph_step

    model = build(lambda: paddle.nn.Sequential(*[MatMLP([width, width]) for _ in range(layers)]), 1)
    REFS.extend([weakref.ref(model)] + [weakref.ref(p) for p in model.parameters()])
    draw = normal(1)
    x, dy = host_tensor(draw(8, width)), host_tensor(draw(8, width))

    def step(x, dy):
        y = model(x)
        y.backward(dy)
        return y

    graphed = autocudagraph_step(step, optimizers=[], backend="cuda", warmup_steps=2)
    for _ in range(5):
        graphed(x, dy)
        for p in model.parameters():
            p.clear_gradient(False)
    graphed.reset()


def raw_graph(width=1024, reset_first=False):
    """Paddle's own CUDAGraph of two matmuls; ``reset_first``: the graph is reset while the tensors its
    capture allocated from its pool are still alive, and they die after (the order a wrapper's release
    takes when something still holds a static buffer)."""
    from paddle.device.cuda.graphs import CUDAGraph

    w = paddle.to_tensor(numpy.random.rand(width, width).astype("float32"))
    x = paddle.to_tensor(numpy.random.rand(8, width).astype("float32"))
    g = CUDAGraph()
    g.capture_begin()
    y = paddle.matmul(x, w)
    y2 = paddle.matmul(y, w)
    g.capture_end()
    g.replay()
    REFS.extend([weakref.ref(w)])
    if reset_first:
        g.reset()
        del y, y2
    else:
        del y, y2
        g.reset()


def main():
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    with device("gpu"):
        settled("start")
        train(False, False, {})
        settled("eager model trained and dropped")
        raw_graph()
        settled("Paddle CUDAGraph of two matmuls captured, replayed, its outputs dropped, then reset")
        raw_graph(reset_first=True)
        settled("Paddle CUDAGraph of two matmuls captured, replayed, reset, then its outputs dropped")
        graphed_function()
        settled("autocudagraph of a function of two matmuls under no_grad, reset(), dropped")
        forward_only()
        settled("graphed per layer, forward only under no_grad, dropped")
        whole_step()
        settled("autocudagraph_step of forward + backward, reset(), dropped")
        for reset, options in ((True, {}), (False, {}), (True, {"chain_calls": False}), (False, {"chain_calls": False}),
                               (True, {"clone_param_grads": True}), (True, {"clone_outputs": False})):
            train(True, reset, options)
            settled(f"graphed per layer {options}, {'reset()' if reset else 'no reset()'}, dropped")


if __name__ == "__main__":
    main()
