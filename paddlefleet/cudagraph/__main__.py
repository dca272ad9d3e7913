"""Command line: ``python -m paddlefleet.cudagraph demo [--steps N]``."""

import argparse
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m paddlefleet.cudagraph")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small model eagerly and graphed, side by side")
    demo.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    from .demo.main import run_demo

    return run_demo(steps=args.steps)


if __name__ == "__main__":
    sys.exit(main())
