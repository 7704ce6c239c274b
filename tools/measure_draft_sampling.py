"""Sampled decoding on the demo pair: tau with DFlash candidates drawn from q (`sample`) vs q's argmax
(`argmax`, one-hot q), on the held-out prompts. Writes bench/results/draft_sampling.json.

    python tools/measure_draft_sampling.py [--new-tokens 64] [--seeds 2]"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from strata import demo  # noqa: E402
from strata.dflash.drafter import load_drafter  # noqa: E402
from strata.models.loader import load_target  # noqa: E402
from strata.engine.decode import Engine  # noqa: E402
from strata.engine.sampling import SamplingParams  # noqa: E402
from strata.engine.stats import Acceptance  # noqa: E402
from strata.tokenizer import Tokenizer  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--new-tokens", type=int, default=64)
ap.add_argument("--seeds", type=int, default=2)
ap.add_argument("--out", default="bench/results/draft_sampling.json")
args = ap.parse_args()
torch.set_num_threads(2)
target = load_target(demo.TARGET)
tok = Tokenizer.from_folder(demo.TARGET)
prompts = [tok.encode(p) for p in json.loads(demo.EVAL_PROMPTS.read_text())]
results = []
for temperature, top_p in [(0.7, 1.0), (1.0, 1.0), (1.0, 0.9)]:
    for mode in ("sample", "argmax"):
        eng = Engine(target, load_drafter(demo.DRAFTER, target, max_len=2048), max_len=2048, draft_sampling=mode)
        total = Acceptance()
        t0 = time.time()
        for seed in range(args.seeds):
            for i, p in enumerate(prompts):
                res = eng.generate(p, args.new_tokens, params=SamplingParams(temperature, 0, top_p, seed * 1000 + i))
                total = total.merge(res.acceptance)
        row = {"temperature": temperature, "top_p": top_p, "draft_sampling": mode, "tau": total.tau,
               "rounds": total.rounds, "per_position_acceptance": total.per_position,
               "seconds": round(time.time() - t0, 1)}
        print(row, flush=True)
        results.append(row)
out = {"what": "demo pair, held-out prompts (src/strata/demo/eval_prompts.json), W=8, CPU float32",
       "prompts": len(prompts), "seeds": args.seeds, "new_tokens": args.new_tokens, "results": results}
Path(args.out).write_text(json.dumps(out, indent=1))
