"""Check Strata's DFlash2 and DSpark drafters against llama.cpp itself. Drafters in the reference Hugging Face layout
are made from the demo drafter (its layers and taps, so that they draft with acceptance): DFlash2DraftModel with
convolutions near the identity (tap 0 of each base kernel about 1, small dynamic kernels) and a random candidate
selector of two strengths, so that the selector decides among candidates; DSparkDraftModel with a random Markov
head and confidence head, drafting from the anchor's slot and after it (`--spec-type draft-dspark`). Per drafter:
- llama.cpp's convert_hf_to_gguf.py and `strata convert-dflash` write the same tensors, types and llama.cpp keys;
- `llama-speculative-simple --spec-type draft-dflash` on the demo target (converted by llama.cpp, F32) with the
  converter's file, and Strata with the same file, accept the same drafts in every round they anchor at the same
  position (llama.cpp's first round anchors on the prompt's last token, Strata's on the first token generated)
  and give the same text; Strata equals its target-only decoding;
- llama.cpp decodes Strata's own GGUF exactly as the converter's; llama-quantize's Q8_0 of it and Strata's
  `convert-dflash --type Q8_0` hold the same blocks;
- how often the selector's pick differs from the slot's argmax (Strata's walk), so a check that passes is one the
  selector took part in;
- with --spec-draft-p-min / --draft-p-min P_MIN (the DFlash2 drafter of strength 1, the DSpark one after the
  anchor, the demo's DFlash drafter): the same accepted drafts in every round anchored alike, equal to target-only.
Prints one line per check and exits 1 on any difference. Never from CI (llama.cpp is built by
../shared/tools/build_llamacpp.sh; its converter needs ../shared/tools/lcpp_convert.py for the demo's vocabulary).

usage: python tools/llamacpp_dflash2_check.py LLAMA_CPP_SOURCE_DIR LLAMA_CPP_BIN_DIR LCPP_CONVERT_PY [OUT.json]"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root / "src")]

from strata.dflash import dflash2  # noqa: E402
from strata.dflash.converter import convert_hf_to_gguf, export_gguf_to_hf  # noqa: E402
from strata.engine.decode import Engine  # noqa: E402
from strata.pair import PairSpec, load_pair  # noqa: E402

DEMO = root / "src" / "strata" / "demo"
PROMPTS = ["def quicksort(arr):", "class Stack:\n    def push(self, item):"]
TAPS, GROUP, RANK, TOP_K = 3, 32, 16, 8
P_MIN = 0.5
failed = []


def check(ok: bool, line: str) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {line}", flush=True)
    if not ok:
        failed.append(line)


def demo_folder(out: Path, arch: str, extra: dict, seed: int, tensors_of) -> Path:
    """The demo drafter's folder as another architecture: its config with `extra` (DFlash2's keys into
    dflash_config), its tensors plus tensors_of(config, generator)."""
    plain = out.parent / "demo-hf"
    if not plain.exists():
        export_gguf_to_hf(DEMO / "drafter-dflash.gguf", plain, progress=False)
    shutil.copytree(plain, out)
    cfg = json.loads((plain / "config.json").read_text())
    cfg["architectures"] = [arch]
    cfg["dflash_config"].update(extra.pop("dflash_config", {}))
    cfg.update(extra)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = load_file(plain / "model.safetensors")
    tensors.update(tensors_of(cfg, torch.Generator().manual_seed(seed)))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def dflash2_folder(out: Path, strength: float) -> Path:
    """The demo drafter as a DFlash2 folder: near-identity convolutions, a selector of this scale."""
    def tensors(cfg, gen):
        hidden, vocab, new = cfg["hidden_size"], cfg["vocab_size"], {}
        for n in range(cfg["num_hidden_layers"]):
            for conv in ("attention_conv", "mlp_conv"):
                base = torch.randn(2, TAPS, hidden, generator=gen) * 0.05
                base[:, 0] += 1.0
                new[f"layers.{n}.{conv}.base_kernel"] = base.bfloat16()
                new[f"layers.{n}.{conv}.kernel_projection.weight"] = \
                    (torch.randn(2 * TAPS * hidden // GROUP, hidden, generator=gen) * 0.01).bfloat16()
        for book in ("predecessor", "successor"):
            new[f"candidate_selector.{book}_codebook"] = (torch.randn(vocab, RANK, generator=gen) * strength).bfloat16()
        new["candidate_selector.hidden_projection.weight"] = (torch.randn(RANK, hidden, generator=gen) * 0.1).bfloat16()
        return new

    keys = dict(conv_kernel_size=TAPS, conv_group_size=GROUP, selector_rank=RANK, selector_top_k=TOP_K)
    return demo_folder(out, "DFlash2DraftModel", {"dflash_config": keys}, 1, tensors)


def dspark_folder(out: Path, anchor: bool) -> Path:
    """The demo drafter as a DSpark folder: a random Markov head and confidence head."""
    def tensors(cfg, gen):
        hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
        return {"markov_head.markov_w1.weight": torch.randn(vocab, RANK, generator=gen).bfloat16(),
                "markov_head.markov_w2.weight": (torch.randn(vocab, RANK, generator=gen) * 0.5).bfloat16(),
                "confidence_head.proj.weight": (torch.randn(1, hidden + RANK, generator=gen) * 0.1).bfloat16(),
                "confidence_head.proj.bias": torch.zeros(1)}

    return demo_folder(out, "DSparkDraftModel", {"sample_from_anchor": anchor, "markov_head_type": "vanilla"}, 2,
                       tensors)


def lcpp_convert(tools: tuple, src: Path, out: Path, *flags: str) -> None:
    source, _, convert = tools
    env = {**os.environ, "PYTHONPATH": str(Path(source) / "gguf-py")}
    subprocess.run([sys.executable, convert, str(Path(source) / "convert_hf_to_gguf.py"), str(src), "--outfile",
                    str(out), *flags], check=True, capture_output=True, env=env)


def trimmed(shape) -> list[int]:
    """A ggml shape without its trailing ones (llama-quantize writes a one-row matrix as 1-D)."""
    dims = [int(d) for d in shape]
    while len(dims) > 1 and dims[-1] == 1:
        dims.pop()
    return dims


def same_files(a: Path, b: Path) -> bool:
    ra, rb = gguf.GGUFReader(str(a)), gguf.GGUFReader(str(b))
    ta, tb = {t.name: t for t in ra.tensors}, {t.name: t for t in rb.tensors}
    if set(ta) != set(tb):
        return False
    for name, t in ta.items():
        u = tb[name]
        if t.tensor_type != u.tensor_type or trimmed(t.shape) != trimmed(u.shape) or \
                not np.array_equal(np.asarray(t.data).ravel(), np.asarray(u.data).ravel()):
            return False
    keys = {k for k in ra.fields if k.startswith("dflash.") or k == "tokenizer.ggml.mask_token_id"}
    return keys == {k for k in rb.fields if k.startswith("dflash.") or k == "tokenizer.ggml.mask_token_id"} and \
        all(ra.fields[k].contents() == rb.fields[k].contents() for k in keys)


def speculative_simple(bins: Path, target: Path, drafter: Path, prompt: str, n: int,
                       kind: str = "draft-dflash", p_min: float = 0.0) -> tuple[str, list[int]]:
    """llama.cpp's greedy speculative decoding: (its text, drafts accepted per round)."""
    done = subprocess.run([str(bins / "llama-speculative-simple"), "-m", str(target), "-md", str(drafter),
                           "--spec-type", kind, "--spec-draft-n-max", "7", "--spec-draft-p-min", str(p_min),
                           "-p", prompt, "-n", str(n), "--temp", "0", "--top-k", "1", "-c", "2048", "-t", "2",
                           "-lv", "5"], capture_output=True, text=True, timeout=600)
    accepted = [int(a) for a in re.findall(r"accepted (\d+)/\d+ draft tokens", done.stderr)]
    return done.stdout, accepted


def anchors(start: int, accepted: list[int]) -> dict[int, int]:
    """Each round's anchor position -> the drafts it accepted (a round commits them and one more token)."""
    out, pos = {}, start
    for a in accepted:
        out[pos] = a
        pos += a + 1
    return out


def compare(bins: Path, target: Path, pair, label: str, theirs: Path, ours: Path | None, kind: str, picks: dict,
            p_min: float = 0.0) -> list[dict]:
    """Both engines on each prompt with one drafter file: the same accepted drafts in every round anchored at the
    same position, the same text, Strata equal to target-only; with ours, llama.cpp decodes it as theirs."""
    rows = []
    for prompt in PROMPTS:
        text, accepted = speculative_simple(bins, target, theirs, prompt, 80, kind, p_min)
        ids = pair.tokenizer.encode(prompt)
        picks.clear()
        res = Engine(pair.target, pair.drafter, max_len=2048, window=8, draft_p_min=p_min).generate(ids, 64)
        base = Engine(pair.target, max_len=2048).generate(ids, 64).output_ids
        mine = [a - 1 for a in res.accept_lengths]
        # llama.cpp's first round anchors on the prompt's last token, Strata's on the first one generated:
        # rounds at the same anchor position must accept alike (those before Strata's last, which the
        # budget may cut; llama.cpp decodes 16 tokens further)
        at_theirs, at_mine = anchors(len(ids) - 1, accepted), anchors(len(ids), mine[:-1])
        common = sorted(set(at_theirs) & set(at_mine))
        same = len(common) >= len(mine) // 2 and all(at_theirs[p] == at_mine[p] for p in common) and \
            pair.tokenizer.decode(res.output_ids) in text
        check(same and res.output_ids == base,
              f"{label} {prompt[:20]!r}: {len(common)} rounds at the same anchor accept alike "
              f"(llama.cpp {accepted}, Strata {mine}; the selector moved {picks.get('moved', 0)} of "
              f"{picks.get('slots', 0)} picks off the argmax)")
        row = {"prompt": prompt, "llamacpp_accepted": accepted, "strata_accepted": mine,
               "rounds_at_common_anchors": len(common), "identical_to_target_only": res.output_ids == base,
               "selector_moved": picks.get("moved", 0), "slots": picks.get("slots", 0)}
        if ours is not None:
            again = speculative_simple(bins, target, ours, prompt, 80, kind, p_min)
            note = ""
            if again != (text, accepted):  # llama.cpp once in a while differs from itself: run both again
                note = (f" (after a second run of both; the first differed: text {again[0] == text}, rounds "
                        f"{again[1]} vs {accepted})")
                again, first = (speculative_simple(bins, target, f, prompt, 80, kind, p_min) for f in (ours, theirs))
                text, accepted = first if first != (text, accepted) else (text, accepted)
            check(again == (text, accepted), f"{label} {prompt[:20]!r}: llama.cpp decodes "
                                             f"Strata's GGUF as the converter's{note}")
        rows.append(row)
    return rows


def main() -> None:
    if len(sys.argv) not in (4, 5):
        sys.exit(__doc__)
    tools = tuple(sys.argv[1:4])
    bins = Path(sys.argv[2])
    report = {"prompts": PROMPTS, "new_tokens": 64, "window": 8, "drafters": {}, "p_min": {}}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        target = d / "target.gguf"
        lcpp_convert(tools, DEMO / "target", target, "--outtype", "f32")
        picks = {}

        def walk(self, logits, h, anchor, kernels):  # counts the slots whose pick is not the argmax
            tokens, conf = real_walk(self, logits, h, anchor, kernels)
            picks["slots"] = picks.get("slots", 0) + tokens.numel()
            picks["moved"] = picks.get("moved", 0) + int((tokens != logits.argmax(-1)).sum())
            return tokens, conf

        real_walk = dflash2.CandidateSelector.walk
        dflash2.CandidateSelector.walk = walk
        for strength in (0.3, 1.0, "dspark", "dspark after the anchor"):
            if isinstance(strength, float):
                folder, kind = dflash2_folder(d / f"hf-{strength}", strength), "draft-dflash"
            else:
                folder, kind = dspark_folder(d / f"hf-{len(strength)}", strength == "dspark"), "draft-dspark"
            label = f"DFlash2, selector x{strength}" if isinstance(strength, float) else strength
            theirs, ours = d / f"lcpp-{len(label)}.gguf", d / f"strata-{len(label)}.gguf"
            lcpp_convert(tools, folder, theirs, "--target-model-dir", str(DEMO / "target"), "--outtype", "bf16")
            convert_hf_to_gguf(folder, ours, DEMO / "target")
            check(same_files(theirs, ours), f"{label}: llama.cpp's converter and Strata's write the "
                                            f"same tensors, types and keys")
            quantized, strata_q8 = d / f"lq-{len(label)}.gguf", d / f"sq-{len(label)}.gguf"
            subprocess.run([str(bins / "llama-quantize"), str(ours), str(quantized), "Q8_0"], check=True,
                           capture_output=True)
            convert_hf_to_gguf(folder, strata_q8, DEMO / "target", qtype="Q8_0")
            check(same_files(quantized, strata_q8), f"{label}: llama-quantize's Q8_0 of Strata's GGUF and Strata's "
                                                    f"own --type Q8_0 hold the same blocks, types and keys")
            pair = load_pair(PairSpec(model=str(target), dflash=str(theirs)))
            report["drafters"][label] = compare(bins, target, pair, label, theirs, ours, kind, picks)
            if strength in (1.0, "dspark after the anchor"):  # --spec-draft-p-min: DFlash2's pair-score probability,
                # DSpark's head (the drafter after the anchor: the demo's layers draft from there, so rounds accept)
                report["p_min"][label] = compare(bins, target, pair, f"{label}, p_min {P_MIN}", theirs, None, kind,
                                                 picks, P_MIN)
        pair = load_pair(PairSpec(model=str(target), dflash=str(DEMO / "drafter-dflash.gguf")))
        label = f"DFlash (the demo's), p_min {P_MIN}"  # its top-10 probability
        report["p_min"][label] = compare(bins, target, pair, label, DEMO / "drafter-dflash.gguf", None,
                                         "draft-dflash", picks, P_MIN)
    if len(sys.argv) == 5:
        Path(sys.argv[4]).write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'FAILED: ' + str(len(failed)) if failed else 'all checks passed'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
