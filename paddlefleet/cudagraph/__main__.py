"""Command line: ``python -m paddlefleet.cudagraph demo [--steps N]`` and ``python -m paddlefleet.cudagraph doctor``."""

import argparse
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m paddlefleet.cudagraph")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small model eagerly and graphed, side by side")
    demo.add_argument("--steps", type=int, default=20, help="training steps per run (default 20, at least 4: "
                      "the graphed runs warm up and capture before they replay)")
    sub.add_parser("doctor", help="report Paddle's build, the GPU, whether Paddle's kernels run on it, and the "
                   "backend autocudagraph picks")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from .doctor import run_doctor

        return run_doctor()
    from .demo.main import check_steps, run_demo

    try:
        check_steps(args.steps)
    except ValueError as err:
        parser.error(str(err))
    return run_demo(steps=args.steps)


if __name__ == "__main__":
    sys.exit(main())
