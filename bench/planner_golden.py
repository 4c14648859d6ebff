"""Is a change to the planner a pure speed-up? Dump every fitting plan of ten searches, then compare.

``python -m bench.planner_golden save before.json`` (on the old code), then ``python -m bench.planner_golden
cmp before.json`` (on the new): each search's complete ``PlannerResult.to_json()`` (every fitting candidate
with every field, the counts and the rejected families; not ``elapsed_s``) must be equal, floats bit for bit
(JSON keeps a float's shortest repr, which reads back to the same double). The searches: Llama 2 7B on
16,384 GPUs, Llama 3 405B on 16,384 at 8K and 131K, Llama 3 8B on 64 (plain, both ZeRO-2 accumulations,
a roofline profile, the embed-head split with GPipe and a fixed interleave), 70B on 1,024 with both
ZeRO-2 accumulations, and Mixtral 8x7B on 16 (the MoE search). The dump is about 90 MB: keep it outside
the repository. Not a test: the ranked plans change, rightly, whenever the models change.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from typing import Any

from parallel_lab.hardware import ClusterSpec, StepProfile
from parallel_lab.planner import plan_search
from parallel_lab.planner_constraints import Constraints
from parallel_lab.specs import ModelSpec

#: the fixed-efficiency preset, so that the searches cover both compute paths (the default h100-sxm is fitted)
H100 = ClusterSpec.preset("h100-sxm-prior")
ROOFLINE = replace(H100, profile=StepProfile(overhead_s=1e-4, tp_overlap=0.3))
BOTH = {"zero2_accumulate": ("unsharded", "sharded")}
#: name -> (model, cluster, GPUs, seq, global batch tokens, Constraints fields)
SEARCHES: dict[str, tuple[str, ClusterSpec, int, int, str, dict[str, Any]]] = {
    "7b-16k": ("llama2-7b", H100, 16384, 4096, "4M", {}),
    "405b-8k": ("llama3-405b", H100, 16384, 8192, "16M", {}),
    "405b-131k": ("llama3-405b", H100, 16384, 131072, "16M", {}),
    "8b-64": ("llama3-8b", H100, 64, 8192, "1M", {}),
    "8b-64-z2acc": ("llama3-8b", H100, 64, 8192, "1M", BOTH),
    "70b-1024-z2acc": ("llama3-70b", H100, 1024, 8192, "4M", BOTH),
    "mixtral-16": ("mixtral-8x7b", H100, 16, 4096, "512K", {}),
    "8b-64-roof": ("llama3-8b", ROOFLINE, 64, 8192, "1M", {}),
    "8b-64-gpipe-eh": ("llama3-8b", H100, 64, 8192, "1M", {"schedules": ("1f1b", "gpipe", "interleaved", "zb-h1"),
                                                           "pp_split": "embed-head", "fixed": {"interleave": 2}}),
    "8b-64-eh": ("llama3-8b", H100, 64, 8192, "1M", {"pp_split": "embed-head"}),
}


def dump(name: str) -> dict[str, Any]:
    """The complete result of one search, as JSON-ready data (without the time it took)."""
    model, cluster, gpus, seq, tokens, kw = SEARCHES[name]
    res = plan_search(ModelSpec.preset(model), cluster, gpus, seq, global_batch_tokens=tokens,
                      constraints=Constraints(**kw))
    out = res.to_json()
    out.pop("elapsed_s")
    return json.loads(json.dumps(out))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or args[0] not in ("save", "cmp"):
        print("usage: python -m bench.planner_golden save|cmp FILE [SEARCH ...]; searches: " + ", ".join(SEARCHES))
        return 2
    mode, path, names = args[0], args[1], args[2:] or list(SEARCHES)
    if mode == "save":
        saved = {}
        for name in names:
            t = time.perf_counter()
            saved[name] = dump(name)
            print(f"{name}: {saved[name]['candidates']:,} candidates, {saved[name]['fitting']:,} fit "
                  f"({time.perf_counter() - t:.1f} s with the JSON)")
        with open(path, "w") as f:
            json.dump(saved, f)
        return 0
    with open(path) as f:
        saved = json.load(f)
    differ = 0
    for name in names:
        got, want = dump(name), saved[name]
        if got == want:
            print(f"{name}: identical ({got['fitting']:,} plans)")
            continue
        differ += 1
        first = next((i for i, (a, b) in enumerate(zip(got["plans"], want["plans"], strict=False)) if a != b), None)
        print(f"{name}: DIFFERENT: {len(got['plans']):,} plans against {len(want['plans']):,}; first differing "
              f"rank {first}; other fields differing: {[k for k in got if k != 'plans' and got[k] != want.get(k)]}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
