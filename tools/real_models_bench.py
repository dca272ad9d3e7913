"""Speed of the docs/guides/recipes.md recipes on a GPU: eager vs graphed training steps, same results.

Run on a GPU machine from the repository root (PaddleFormers optional):

    python tools/real_models_bench.py [--steps 50] [--batch 32] [--size 64]
    python tools/real_models_bench.py --backend simulate     # CPU smoke run: 4 steps, batch 2, 32 x 32

For each model the same training loop runs eagerly and with the recipe's blocks graphed (cuda
backend), from the same state and seed; it prints ms per step (after the warmup and capture steps,
one device sync per loop) and whether every loss and parameter was bitwise equal to eager.

Exit code: 0 when every model that ran was bitwise equal to eager and replayed, 1 otherwise, 2 when
asked for the cuda backend where there is no GPU.
"""

import argparse
import os
import sys
import time

import numpy as np
import paddle

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from testkit.cli import BACKEND_HELP, require_gpu, sized, sized_help  # noqa: E402
from tests.integration.test_real_models import (  # noqa: E402
    graph_all,
    paddleformers_skip_reason,
    stages,
    state_of,
    tiny_llama,
    vision_model,
)


def sync():
    if paddle.device.get_device() != "cpu":
        paddle.device.synchronize()


def run(model, inputs, loss_fn, steps_before):
    paddle.seed(3)
    opt = paddle.optimizer.Momentum(learning_rate=0.01, momentum=0.9, parameters=model.parameters())
    losses = []
    for i, x in enumerate(inputs):
        if i == steps_before:
            sync()
            start = time.perf_counter()
        loss = loss_fn(model, x)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(loss)
    sync()
    per_step = (time.perf_counter() - start) / (len(inputs) - steps_before) * 1e3
    return per_step, [l.numpy() for l in losses], state_of(model)


def compare(name, factory, blocks_of, inputs, loss_fn, backend):
    paddle.seed(1)
    eager = factory()
    graphed = factory()
    graphed.set_state_dict(eager.state_dict())
    blocks = blocks_of(graphed)
    graph_all(blocks, backend, warmup_steps=1)
    t_eager, l_eager, s_eager = run(eager, inputs, loss_fn, 2)
    t_graph, l_graph, s_graph = run(graphed, inputs, loss_fn, 2)
    same = all(np.array_equal(a, b) for a, b in zip(l_eager, l_graph)) and all(
        np.array_equal(s_eager[k], s_graph[k]) for k in s_eager)
    replays = sum(b.forward.stats()["replays"] for b in blocks)
    verdict = ("bitwise yes" if same else "bitwise NO") if replays else "NOT CHECKED (no replay)"
    print(f"{name:14s} eager {t_eager:8.2f} ms/step  graphed {t_graph:8.2f} ms/step  "
          f"speed-up {t_eager / t_graph:5.2f}x  {verdict} ({replays} block replays)")
    return same and replays > 0


#: (full size on a GPU, smoke size with --backend simulate)
SIZES = {"steps": (50, 4), "batch": (32, 4), "size": (64, 32)}
MODELS = ("resnet18", "resnet50", "mobilenet_v2", "llama")
SMOKE_MODELS = ("resnet18", "mobilenet_v2", "llama")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("cuda", "simulate"), default="cuda", help=BACKEND_HELP)
    for name, text in (("steps", "training steps per run (at least 4)"), ("batch", "batch size"),
                       ("size", "image side")):
        parser.add_argument(f"--{name}", type=int, help=sized_help(text, *SIZES[name]))
    parser.add_argument("--models", help=sized_help("comma-separated, from " + ", ".join(MODELS), ",".join(MODELS),
                                                    ",".join(SMOKE_MODELS)))
    args = parser.parse_args()
    require_gpu("tools/real_models_bench.py", args.backend)
    for name, (full, smoke) in SIZES.items():
        setattr(args, name, sized(getattr(args, name), args.backend, full, smoke))
    models = args.models.split(",") if args.models else (MODELS if args.backend == "cuda" else SMOKE_MODELS)
    if set(models) - set(MODELS):
        parser.error(f"unknown model(s) {sorted(set(models) - set(MODELS))}; known: {', '.join(MODELS)}")
    if args.steps < 4:
        parser.error(f"--steps must be >= 4 (2 untimed steps: warmup and capture; then replays), got {args.steps}")
    paddle.set_device("gpu" if args.backend == "cuda" else "cpu")
    if args.backend == "cuda":  # eager and graphed runs must each be reproducible to compare them
        try:
            paddle.set_flags({"FLAGS_cudnn_deterministic": True})
        except ValueError:
            print("FLAGS_cudnn_deterministic is not available: bitwise results may vary run to run")
    rs = np.random.RandomState(0)
    images = [(paddle.to_tensor(rs.randn(args.batch, 3, args.size, args.size).astype("float32")),
               paddle.to_tensor(rs.randint(0, 10, (args.batch, 1)), dtype="int64")) for _ in range(args.steps)]

    def ce(model, xy):
        return paddle.nn.functional.cross_entropy(model(xy[0]), xy[1])

    ok = True
    for name in [m for m in models if m != "llama"]:
        ok &= compare(name, lambda n=name: vision_model(n), lambda m, n=name: stages(n, m), images, ce, args.backend)
    reason = paddleformers_skip_reason() if "llama" in models else None
    if "llama" not in models:
        return 0 if ok else 1
    if reason:
        print(f"llama          SKIPPED (not run): {reason}")
        return 0 if ok else 1
    ids = [paddle.to_tensor(rs.randint(0, 64, (args.batch, 64)), dtype="int64") for _ in range(args.steps)]
    ok &= compare("llama (tiny)", lambda: tiny_llama(attention_dropout=0.1, max_position_embeddings=128),
                  lambda m: list(m.model.layers), ids, lambda m, x: m(x, labels=x)[0], args.backend)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
