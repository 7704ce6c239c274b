"""Fine-tune the demo drafter on self-distilled continuations sampled at a temperature.

Greedy continuations of training-corpus prompts replay text the small target has memorised, which
is not how it behaves on unseen code; sampled continuations leave those paths, so the drafter learns
the target's behaviour where it is unsure too.

    python tools/finetune_demo_drafter.py DEMO_DIR STDLIB_DIR [--steps N] [--temperature T]"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_demo import encode_all, read, stdlib_files  # noqa: E402
from strata.dflash.artifact import load_artifact  # noqa: E402
from strata.dflash.train import DrafterTrainer, TrainConfig, self_distill  # noqa: E402
from strata.models.decoder import load_target  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("demo")
ap.add_argument("stdlib")
ap.add_argument("--steps", type=int, default=2500)
ap.add_argument("--temperature", type=float, default=0.8)
ap.add_argument("--num-sequences", type=int, default=6144)
ap.add_argument("--lr", type=float, default=5e-4)
ap.add_argument("--seed", type=int, default=1)
ap.add_argument("--out")
args = ap.parse_args()
demo = Path(args.demo)
device = "cuda" if torch.cuda.is_available() else "cpu"
t0 = time.time()
target = load_target(demo / "target", device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
tok = Tokenizer.from_file(str(demo / "target" / "tokenizer.json"))
train_files, _ = stdlib_files(args.stdlib)
ids = encode_all(tok, read(train_files)).tolist()
art = load_artifact(demo / "drafter")
tc = TrainConfig(layers=art.cfg.num_layers, block_size=art.cfg.block_size, taps=art.cfg.target_layer_ids,
                 steps=args.steps, batch_size=64, lr=args.lr, warmup=0.02, num_sequences=args.num_sequences,
                 temperature=args.temperature, seed=args.seed, eval_every=max(1, args.steps // 5), save_every=10 ** 9)
seqs = self_distill(target, ids, tc, device, progress=False).cpu()
print(f"distilled {len(seqs)} sequences at T={args.temperature} in {time.time() - t0:.1f}s", flush=True)
trainer = DrafterTrainer(target, tc, Path(args.out or demo / "drafter_ft"), device)
trainer.model.load_state_dict({k: v.float() for k, v in art.tensors.items()})
trainer.set_data(seqs)
for h in trainer.fit(progress=False):
    print("drafter", h, flush=True)
(trainer.out / "checkpoint.pt").unlink(missing_ok=True)
print(f"done in {time.time() - t0:.1f}s", flush=True)
