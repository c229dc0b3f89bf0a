"""Correct pairings of ``attn-ledger compare`` on small real models: how close each comes to its bound.

For every family, pairing and seed given (eager against flex_attention where the family refuses SDPA), prints one line: the worst ratio of a block's added error to the plain
error at that block (the bound is ``COMPARE_FACTOR`` times it, plus one eps), the same for the embeddings and the
logits, and the top-k disagreements. Run it at each CPU capability (``ATEN_CPU_CAPABILITY=default|avx2``) before
changing :data:`attn_ledger.tolerance.COMPARE_FACTOR`. Needs transformers (the ``real`` extra).

    python scripts/compare_margins.py --families llama,mistral --seeds 0,1
"""

from __future__ import annotations

import argparse
import math
import os

SDPA_REFUSED = ("gemma2",)  # transformers refuses SDPA here: eager against flex_attention instead
PAIRINGS = ("attn-implementation=eager,sdpa", "attn-implementation=eager,sdpa@bfloat16", "dtype=float32,bfloat16",
            "padding-side", "padding-side@bfloat16")


def measure(family: str, pairing: str, seed: int, seq_len: int) -> dict:
    from attn_ledger.probes.model.compare import compare, parse_vary, runs
    from attn_ledger.probes.model.driver import LocalModel, setup
    from attn_ledger.probes.model.inputs import InputPlan

    vary, _, dtype = pairing.partition("@")
    if family in SDPA_REFUSED:
        vary = vary.replace("sdpa", "flex_attention")
    v = parse_vary(vary)
    plan = InputPlan(2, seq_len, "none" if v.kind == "padding-side" else "left", seed)
    r = runs(v, family, dtype=dtype or "float32", plan=plan)
    loaded, _ = setup(r.args())
    report = compare(LocalModel(loaded), r)
    worst: dict[str, float] = {"block": 0.0, "embeddings": 0.0, "logits": 0.0}
    for row in report.rows:
        for c in row.checks:
            plain = c.data.get("plain_error") if c.data else None
            if plain is None or c.value is None:
                continue
            ratio = c.value / plain if plain > 0 else (0.0 if c.value == 0 else math.inf)
            key = "block" if c.name == "added_error" else c.name
            worst[key] = max(worst[key], ratio)
    topk = next((c for r_ in report.rows for c in r_.checks if c.name == "top_k"), None)
    return {**worst, "verdict": report.verdict, "top_k": None if topk is None else topk.value,
            "top1": None if topk is None else topk.data["top1_differ"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default="llama,mistral,qwen2,gemma2")
    p.add_argument("--pairings", default=";".join(PAIRINGS))
    p.add_argument("--seeds", default="0")
    p.add_argument("--seq-len", type=int, default=24)
    a = p.parse_args()
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "unset")
    overall = 0.0
    for family in a.families.split(","):
        for pairing in a.pairings.split(";"):
            for seed in (int(s) for s in a.seeds.split(",")):
                m = measure(family, pairing, seed, a.seq_len)
                overall = max(overall, m["block"], m["embeddings"], m["logits"])
                print(f"{cap:8} {family:8} {pairing:42} seed {seed}: {m['verdict']:4} block {m['block']:.3f} "
                      f"embeddings {m['embeddings']:.3f} logits {m['logits']:.3f} top_k {m['top_k']} top1 {m['top1']}",
                      flush=True)
    print(f"worst added / plain: {overall:.3f}")


if __name__ == "__main__":
    main()
