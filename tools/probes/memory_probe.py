"""Where a graphed runner's reserved device memory goes, phase by phase (a probe, not a report tool).

    python tools/probes/memory_probe.py [--configs xformer24x1024_b32_perlayer,mlp16x512_b16] [--out DIR]

For each config and variant (eager; autocudagraph default; without grad stacks; chain_calls=False),
one fresh process records reserved / allocated MiB after the model is built, around every cache
release the package makes (before / after), and after each of 6 steps, and the wrappers' memory stats.
"""

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tools"))

MIB = 1 << 20


def child(config, variant):
    import paddle
    from benchmark.paddle_runs import Setup
    from benchmark.timing import pick_configs
    from paddlefleet.cudagraph import autocudagraph
    from paddlefleet.cudagraph.grads import stacks

    mod = paddle.device.cuda
    events = []

    def note(what):
        events.append((what, round(mod.memory_reserved() / MIB, 1), round(mod.memory_allocated() / MIB, 1)))

    release = mod.empty_cache

    def noted():
        note("  before a release")
        release()
        note("  after the release")

    cfg = pick_configs(config, False)[0]
    s = Setup(cfg, "cuda")
    import gc
    gc.collect()
    release()
    note("start (setup's reference done, cache released)")
    if variant == "no_stacks":
        stacks.GROUP_MAX_BYTES = 0
    model = s.model()
    note("model built")
    targets = s.targets(model)
    if variant != "eager":
        options = {"chain_calls": False} if variant == "no_chain" else {}
        for t in targets:
            autocudagraph(t, backend="cuda", **options)
    mod.empty_cache = noted
    try:
        for i in range(6):
            s.step(model)()
            s.sync()
            note(f"after step {i + 1}")
    finally:
        mod.empty_cache = release
    out = {"events": events}
    if variant != "eager":
        st = [t.forward.stats() for t in targets]
        out["pool_MiB"] = round(sum(x["pool_bytes"] or 0 for x in st) / MIB, 1)
        out["held_MiB"] = round(sum(x["held_bytes"] or 0 for x in st) / MIB, 1)
        out["memory"] = {k: round(sum((x["memory"].get(k) or 0) for x in st) / MIB, 1)
                         for k in st[0]["memory"] if isinstance(st[0]["memory"].get(k), (int, float, type(None)))}
        out["counters"] = {k: sum(x[k] for x in st) for k in ("captures", "replays")}
    print(json.dumps(out))


def main():
    p = argparse.ArgumentParser(description="reserved / allocated device memory of bench runners, phase by phase")
    p.add_argument("--configs", default="xformer24x1024_b32_perlayer,mlp16x512_b16",
                   help="comma-separated tools/bench.py configs")
    p.add_argument("--variants", default="eager,default,no_stacks,no_chain",
                   help="comma-separated runners: eager, default, no_stacks (GROUP_MAX_BYTES = 0), no_chain")
    p.add_argument("--out", help="folder for memory_probe.md")
    p.add_argument("--child", nargs=2, help="internal: one config and variant in this process")
    a = p.parse_args()
    if a.child:
        child(*a.child)
        return
    lines = []
    for config in a.configs.split(","):
        for variant in a.variants.split(","):
            r = subprocess.run([sys.executable, __file__, "--child", config, variant], capture_output=True, text=True,
                               timeout=300)
            lines.append(f"## {config} / {variant} (rc {r.returncode})")
            try:
                data = json.loads(r.stdout.strip().splitlines()[-1])
            except Exception:  # noqa: BLE001
                lines.append("```\n" + r.stdout[-2000:] + r.stderr[-3000:] + "\n```")
                continue
            lines.append("| phase | reserved MiB | allocated MiB |\n|---|---|---|")
            lines += [f"| {w} | {res} | {al} |" for w, res, al in data["events"]]
            lines += [f"- {k}: {v}" for k, v in data.items() if k != "events"]
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(os.path.join(a.out, "memory_probe.md"), "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
