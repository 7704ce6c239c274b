"""Check Strata's MTP (multi-token-prediction) speculative decoding against llama.cpp's `--spec-type draft-mtp`:
the same greedy tokens and the same drafts accepted. Per family (qwen3_5 dense, qwen3_5_moe, qwen3_next), a tiny
checkpoint that transformers writes (tests/hybrid_layout.py's shapes, the demo's vocabulary) with an MTP block in
the hub's layout (`mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.norm`, `mtp.layers.0.*`;
a MoE block's routed experts one tensor per expert, `mtp.layers.0.mlp.experts.{e}.{gate,up,down}_proj.weight`, as
the Qwen3.5/3.6-MoE and Qwen3-Next checkpoints hold them; Qwen3-Next's config without mtp_num_hidden_layers),
converted by llama.cpp's convert_hf_to_gguf.py keeping the block (F32: llama.cpp's CPU path is exact there).
A random block drafts nothing the target accepts, so (see checkpoint(), --mtp-init / --quiet / --mix): the target's
linear-attention layers' outputs are scaled down (QUIET) and the block is the last full-attention layer fed mostly
the token's embedding plus a share (MIX) of the hidden state it is paired with. Per prompt:
- llama-server (`--spec-type draft-mtp --spec-draft-n-max N --spec-draft-n-min 0 --spec-draft-p-min 0`; a fresh
  server per prompt: the block pairs the prompt's first token with the hidden row the previous request left
  behind, zeros only on a new server) decodes NEW tokens greedily: its tokens, timings.draft_n / draft_n_accepted
  and (LLAMA_TRACE=1) each round's accepted/drafted;
- a transformers reference of llama.cpp's draft-mtp (the block as a one-layer model of the family fed
  fc([enorm(embed(x_p)), hnorm(h_{p-1})]), h_{-1} = 0, drafting on its own normed output; llama.cpp's draft
  limit; on qwen3next, which has no recurrent-state rollback, llama.cpp's checkpoint replay and its pairing of a
  replayed anchor) gives the same tokens and rounds;
- Strata (load_target(path, mtp=True), MTPDrafter, window N+1) on the GGUF file and on the checkpoint folder:
  the same tokens, and the same rounds once counted as llama.cpp counts them (it drafts min(N, tokens left - 1)
  per round, none when one token is left; Strata drafts N every round and counts a round's accepted drafts up to
  what the budget delivered); on qwen3_next, whose rollback llama.cpp replaces by its checkpoint replay, the
  reference's rounds without the replay (the block's rounds as an exact rollback gives them);
- with drafts cut at the first candidate whose top-10 softmax is below P (llama-server --spec-draft-p-min P, Strata
  --draft-p-min P; --p-min, default 0.12: this block's candidates rate 0.05-0.3), qwen35 and qwen35moe: the same
  tokens and the same accepted runs (llama.cpp logs no round for an empty draft, so only the rounds that accepted
  something are compared), and llama.cpp's drafts shorter than without the cut.
Prints one line per check and exits 1 on any difference. --llama-only runs llama.cpp and the transformers
reference only (no Strata). Never from CI (llama-server: ../shared/tools/build_llamacpp.sh's flags with
-DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF, target llama-server; its converter
needs ../shared/tools/lcpp_convert.py for the demo's vocabulary).

usage: python tools/llamacpp_mtp_check.py LLAMA_CPP_SOURCE_DIR LLAMA_SERVER_BIN_DIR LCPP_CONVERT_PY [--llama-only]
           [--n-max N] [--new NEW] [--mtp-init mix|embed|hidden|random] [--quiet Q] [--mix M] [--family F ...]
           [--p-min P] [--no-reference] [--keep DIR] [--out JSON]"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root / "src"), str(root / "tests")]

from strata.pair import tokenizer_of  # noqa: E402

from conftest import write_hf_model  # noqa: E402
from hybrid_layout import COMMON, SHAPES  # noqa: E402

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
TEXTS = ["def quicksort(arr):", "import os\nimport sys\n", "class Stack:\n    def push(self, x):",
         "for i in range(10):"]
#: the scale of the linear-attention layers' outputs: on the checkpoint as transformers initialises it (1.0) no
#: one-layer block drafts anything the target accepts (a random model's argmax has thin margins); with the block
#: fed only the embedding, at 0.01 about two thirds of its first drafts are accepted (0.02: a half, 0.05: a few)
#: and the layers still decide the text (no token repeats as it does at 0)
QUIET = 0.01
#: write_hf_model's seed: one whose greedy texts meet no near-tie (a MoE router's second and third expert, the top
#: two logits) where llama.cpp's and torch's float32 rounding part (41, the hybrid check's, has one on qwen3_next)
SEED = 42
#: --mtp-init mix: the hidden state's share of fc beside the embedding's (0.25 leaves almost nothing accepted)
MIX = 0.1
failures = []


def check(ok: bool, line: str) -> None:
    print(("ok   " if ok else "FAIL ") + line, flush=True)
    if not ok:
        failures.append(line)


# --- the checkpoint ------------------------------------------------------------------------------------------------

def checkpoint(folder: Path, family: str, init: str, quiet: float = QUIET, seed: int = SEED, mix: float = MIX) -> Path:
    """A tiny checkpoint of the family, its linear-attention layers' outputs (out_proj, the MLP's / experts' /
    shared expert's down_proj) scaled by `quiet`, with one MTP block made by `init`:
    mix:    the last full-attention layer, fc = [s*I | MIX*s*I] (s: the embedding rows' RMS), pre-fc norms near 1
            (random), the head norm the model's final norm: the block runs that layer on the token's own embedding,
            moved by the hidden state it is paired with (so that pairing, hnorm and the concatenation's order count);
    embed:  as mix, fc = [s*I | 0], pre-fc norms 1: the hidden state plays no part;
    hidden: the last full-attention layer, fc = [0 | I]: the hidden state only;
    random: random fc (0.02) and norms (the hybrid check's block): drafts that are almost never accepted."""
    write_hf_model(folder, family, seed=seed, vocab=4096, **COMMON, **SHAPES[family])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(root / "src/strata/demo/target" / name, folder / name)
    tensors = load_file(folder / "model.safetensors")
    cfg = json.loads((folder / "config.json").read_text())
    for name in tensors:  # quiet layers keep the target near what the one-layer block can see
        layer = re.match(r"model\.layers\.(\d+)\..*(out_proj|down_proj)\.weight$", name)
        if layer and cfg["layer_types"][int(layer.group(1))] == "linear_attention":
            tensors[name] = tensors[name] * quiet
    last = max(i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention")
    prefix, h = f"model.layers.{last}.", cfg["hidden_size"]
    # every tensor of that layer, routed experts one per expert as transformers saves them (and the hub holds them)
    tensors.update({"mtp.layers.0." + k[len(prefix):]: t.clone() for k, t in tensors.items() if k.startswith(prefix)})
    gen = torch.Generator().manual_seed(5)
    eye, zero = torch.eye(h), torch.zeros(h, h)
    s = float(tensors["model.embed_tokens.weight"].pow(2).mean().sqrt())
    if init == "random":
        tensors["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=gen) * 0.02
        for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            tensors[f"mtp.{norm}.weight"] = torch.randn(h, generator=gen) * 0.1
    else:
        fc = {"embed": (s * eye, zero), "mix": (s * eye, mix * s * eye), "hidden": (zero, eye)}[init]
        tensors["mtp.fc.weight"] = torch.cat(fc, dim=1).contiguous()
        for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden"):  # zero-centred: 0 is a scale of 1
            tensors[f"mtp.{norm}.weight"] = torch.randn(h, generator=gen) * 0.1 if init == "mix" else torch.zeros(h)
        tensors["mtp.norm.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, str(folder / "model.safetensors"))
    if family != "qwen3_next":  # Qwen3-Next's config does not name it; the converter counts the mtp.layers
        cfg["mtp_num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def convert(src: Path, convert_py: str, folder: Path, out: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
    subprocess.run([sys.executable, convert_py, str(src / "convert_hf_to_gguf.py"), str(folder), "--outtype", "f32",
                    "--outfile", str(out)], env=env, check=True, capture_output=True)


# --- llama.cpp ---------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(bins: Path, gguf_path: Path, n_max: int, port: int, p_min: float = 0.0) -> list[str]:
    return [str(bins / "llama-server"), "-m", str(gguf_path), "--spec-type", "draft-mtp",
            "--spec-draft-n-max", str(n_max), "--spec-draft-n-min", "0", "--spec-draft-p-min", str(p_min),
            "-c", "512", "-np", "1", "-t", "2", "--host", "127.0.0.1", "--port", str(port)]


def request(prompt: list[int], new: int) -> dict:
    return {"prompt": prompt, "n_predict": new, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
            "return_tokens": True, "stream": False}


def post(port: int, path: str, body: dict | None = None, timeout: float = 300) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def llama_server(bins: Path, gguf_path: Path, prompts: list[list[int]], new: int, n_max: int, log: Path,
                 p_min: float = 0.0) -> list[dict]:
    """Each prompt on a fresh llama-server: its tokens, draft_n, draft_n_accepted, per-round (accepted, drafted)."""
    rows = []
    for i, prompt in enumerate(prompts):
        port = free_port()
        err = log.with_suffix(f".{i}.log")
        with open(err, "w") as f:
            proc = subprocess.Popen(server_command(bins, gguf_path, n_max, port, p_min), stdout=f,
                                    stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env={**os.environ, "LLAMA_TRACE": "1"})
        try:
            for _ in range(600):
                if proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited {proc.returncode}: {err.read_text()[-3000:]}")
                try:
                    if post(port, "/health", timeout=2).get("status") == "ok":
                        break
                except OSError:
                    pass
                time.sleep(0.2)
            out = post(port, "/completion", request(prompt, new))
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        t = out.get("timings", {})
        rows.append({"tokens": out.get("tokens", []), "draft_n": t.get("draft_n", 0),
                     "draft_n_accepted": t.get("draft_n_accepted", 0), "predicted_n": t.get("predicted_n"),
                     "stop_type": out.get("stop_type"), "rounds": traced_rounds(err.read_text())})
    return rows


def traced_rounds(log: str) -> list[list[int]]:
    """The rounds that LLAMA_TRACE=1 logs, as [anchor, accepted, drafted] (anchor: the index among the generated
    tokens of the round's first token, the one sampled before it). A round that rejects a draft on a target whose
    memory cannot drop its last positions (qwen3next: no recurrent-state rollback) logs "(restore checkpoint)":
    the server restores the state from before the round and verifies the accepted drafts and the target's token
    again (a replay, logged as all accepted, counted as the first round's drafts and acceptances); that replay's
    own next token comes with it, so the next round anchors one token further than after a rollback."""
    rounds, anchor, replay = [], 0, False
    for a, d, restored in re.findall(r"accepted\s+(\d+)/\s*(\d+) draft tokens( \(restore checkpoint\))?", log):
        if replay:  # the replay of the round before: its tokens are that round's accepted ones and one more
            replay = False
            continue
        rounds.append([anchor, int(a), int(d)])
        replay = bool(restored)
        anchor += int(a) + (2 if restored else 1)
    return rounds


# --- a transformers reference of llama.cpp's draft-mtp -------------------------------------------------------------

def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The family's zero-centred RMSNorm (the converter stores 1 + w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


class Reference:
    """The checkpoint's target in transformers and its MTP block as a one-layer model of the same family."""

    def __init__(self, folder: Path, scratch: Path):
        import transformers

        self.target = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        tensors = load_file(folder / "model.safetensors")
        cfg = json.loads((folder / "config.json").read_text())
        self.eps = cfg["rms_norm_eps"]
        self.fc = tensors["mtp.fc.weight"]
        self.enorm, self.hnorm = tensors["mtp.pre_fc_norm_embedding.weight"], tensors["mtp.pre_fc_norm_hidden.weight"]
        block = {"model.layers.0." + k[len("mtp.layers.0."):]: t for k, t in tensors.items()
                 if k.startswith("mtp.layers.0.")}
        block.update({"model.norm.weight": tensors["mtp.norm.weight"], "lm_head.weight": tensors["lm_head.weight"],
                      "model.embed_tokens.weight": tensors["model.embed_tokens.weight"]})
        one = scratch / "mtp-as-model"
        one.mkdir(parents=True, exist_ok=True)
        cfg.update(num_hidden_layers=1, layer_types=["full_attention"])
        cfg.pop("mtp_num_hidden_layers", None)
        (one / "config.json").write_text(json.dumps(cfg))
        save_file({k: v.contiguous() for k, v in block.items()}, str(one / "model.safetensors"))
        self.mtp = transformers.AutoModelForCausalLM.from_pretrained(one, dtype=torch.float32).eval()
        self.embed = tensors["model.embed_tokens.weight"]

    @torch.no_grad()
    def hidden(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's normed last hidden rows (llama.cpp's h_nextn) and logits."""
        out = self.target.model(input_ids=torch.tensor([ids]))
        h = out.last_hidden_state[0]
        return h, self.target.lm_head(h)

    @torch.no_grad()
    def draft(self, seq: list[int], h: torch.Tensor, k: int, paired: dict | None = None) -> list[int]:
        """k greedy drafts after seq (its last token sampled, h the target's rows for seq[:-1]); paired: the
        positions whose token llama.cpp pairs with another row than the target's one before it."""
        toks, hs = list(seq), [torch.zeros(h.shape[-1])] + list(h[:len(seq) - 1])
        for p, row in (paired or {}).items():
            hs[p] = row
        out = []
        for _ in range(k):
            e = rms(self.embed[torch.tensor(toks)], self.enorm, self.eps)
            x = torch.cat([e, rms(torch.stack(hs), self.hnorm, self.eps)], dim=-1) @ self.fc.T
            last = self.mtp.model(inputs_embeds=x[None]).last_hidden_state[0, -1]
            d = int(self.mtp.lm_head(last).argmax())
            out.append(d)
            toks.append(d)
            hs.append(last)
        return out

    def generate(self, prompt: list[int], new: int, n_max: int, replay: bool) -> dict:
        """llama-server's greedy draft-mtp loop: the first token from the prompt, then rounds drafting
        min(n_max, left - 1) (none: a plain step), verified greedily; with replay (a target without rollback) a
        round that rejects a draft is verified again and brings one more token (traced_rounds), and the block's
        entry for the round's first token pairs it with the rejected batch's last hidden row: the server restores
        the checkpoint without common_speculative_accept, so the replay's process() starts from the pending row
        the rejected batch left."""
        h, logits = self.hidden(prompt)
        seq, rounds, paired = list(prompt) + [int(logits[-1].argmax())], [], {}
        while len(seq) - len(prompt) < new:
            n_gen = len(seq) - len(prompt)
            k = min(n_max, new - n_gen - 1)
            if k <= 0:
                seq.append(int(self.hidden(seq)[1][-1].argmax()))
                continue
            h, _ = self.hidden(seq)
            drafts = self.draft(seq, h, k, paired)
            verified, logits = self.hidden(seq + drafts)
            preds = logits[len(seq) - 1:].argmax(-1).tolist()
            j = 0
            while j < k and preds[j] == drafts[j]:
                j += 1
            rounds.append([n_gen - 1, j, k])
            if replay and j < k:
                paired[len(seq) - 1] = verified[-1]
            seq += drafts[:j] + [preds[j]]
            if replay and j < k:
                seq.append(int(self.hidden(seq)[1][-1].argmax()))
        return {"tokens": seq[len(prompt):], "rounds": rounds, "draft_n": sum(r[2] for r in rounds),
                "draft_n_accepted": sum(r[1] for r in rounds)}


# --- Strata --------------------------------------------------------------------------------------------------------

def as_llama_counts(accept_lengths: list[int], accepted: int, new: int, n_max: int) -> list[list[int]]:
    """Strata's rounds counted as llama-server counts them: [anchor, accepted, drafted] per round that drafts. A
    round with `left` tokens to go drafts min(n_max, left - 1) there; the last round's accepted drafts (Strata
    counts them up to what the budget delivered) are those within that limit."""
    rows, n_gen, before = [], 1, 0
    for i, delivered in enumerate(accept_lengths):
        k = max(0, min(n_max, new - n_gen - 1))
        a = delivered - 1 if i < len(accept_lengths) - 1 else accepted - before
        before += a
        if k > 0:
            rows.append([n_gen - 1, min(a, k), k])
        n_gen += delivered
    return rows


def strata_generate(path: Path, prompt: list[int], new: int, n_max: int, p_min: float = 0.0) -> dict:
    """Strata's MTP speculative decoding (the API this check is written against; see the brief)."""
    from strata.engine.decode import Engine
    from strata.engine.mtp import MTPDrafter
    from strata.models.loader import load_target

    key = str(path)
    if key not in _targets:
        _targets[key] = load_target(path, mtp=True)
    target = _targets[key]
    res = Engine(target, MTPDrafter(target), max_len=256, window=n_max + 1, draft_p_min=p_min).generate(prompt, new)
    summary = res.acceptance.summary()
    rounds = as_llama_counts(summary["accept_lengths"], summary["accepted"], new, n_max)
    return {"tokens": res.output_ids, "rounds": rounds, "draft_n": sum(r[2] for r in rounds),
            "draft_n_accepted": sum(r[1] for r in rounds), "summary": {k: summary[k] for k in ("drafted", "accepted")}}


_targets: dict = {}


def nonzero(rounds: list[list[int]]) -> list[int]:
    """The accepted counts of the rounds that accepted something, in order (with p_min llama.cpp logs no round
    for an empty draft, so its anchors are not comparable; the accepted runs are)."""
    return [r[1] for r in rounds if r[1]]


def p_min_check(a, path: Path, prompts: list[list[int]], plain: list[dict], log: Path) -> list[dict]:
    """Both engines with drafts cut at the first candidate whose top-10 softmax is below p_min: the same tokens,
    the same accepted runs and totals, and llama.cpp's drafts shorter than without the cut."""
    theirs = llama_server(a.bins, path, prompts, a.new, a.n_max, log, a.p_min)
    out = []
    for text, prompt, lc, row in zip(TEXTS, prompts, theirs, plain):
        ours = strata_generate(path, prompt, a.new, a.n_max, a.p_min)
        label = f"{path.stem} {text[:20]!r} p_min {a.p_min}"
        check(ours["tokens"] == lc["tokens"], f"{label}: Strata's tokens equal llama.cpp's")
        check(nonzero(ours["rounds"]) == nonzero(lc["rounds"]) and ours["draft_n_accepted"] == lc["draft_n_accepted"],
              f"{label}: the same drafts accepted, round by round ({nonzero(lc['rounds'])}; llama.cpp drafted "
              f"{lc['draft_n']} against {row['llama.cpp']['draft_n']} without the cut)")
        out.append({"prompt": text, "llama.cpp": lc, "strata GGUF": ours})
    check(sum(r["llama.cpp"]["draft_n"] for r in out) < sum(r["llama.cpp"]["draft_n"] for r in plain),
          f"{path.stem}: p_min {a.p_min} cut llama.cpp's drafts")
    return out


# --- the check -----------------------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(usage=__doc__)
    ap.add_argument("src", type=Path)
    ap.add_argument("bins", type=Path)
    ap.add_argument("convert_py")
    ap.add_argument("--llama-only", action="store_true", help="llama.cpp and the transformers reference, no Strata")
    ap.add_argument("--n-max", type=int, default=4)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--mtp-init", default="mix", choices=("embed", "mix", "hidden", "random"))
    ap.add_argument("--quiet", type=float, default=QUIET, help="the linear-attention layers' output scale")
    ap.add_argument("--mix", type=float, default=MIX, help="--mtp-init mix: the hidden state's share of fc")
    ap.add_argument("--family", action="append", choices=FAMILIES)
    ap.add_argument("--p-min", type=float, default=0.12,
                    help="also decode with --spec-draft-p-min / --draft-p-min P (0: skip; not on qwen3next)")
    ap.add_argument("--no-reference", action="store_true", help="skip the transformers reference")
    ap.add_argument("--out", type=Path, help="write every number as JSON here")
    ap.add_argument("--keep", type=Path, help="keep the checkpoints, GGUF files and server logs in this folder")
    a = ap.parse_args()
    report = {"n_max": a.n_max, "new": a.new, "mtp_init": a.mtp_init, "quiet": a.quiet, "mix": a.mix, "families": {}}
    with tempfile.TemporaryDirectory() as tmp:
        d = a.keep or Path(tmp)
        d.mkdir(parents=True, exist_ok=True)
        for family in a.family or FAMILIES:
            folder = checkpoint(d / f"{family}-{a.mtp_init}", family, a.mtp_init, a.quiet, mix=a.mix)
            path = d / f"{family}-{a.mtp_init}.gguf"
            convert(a.src, a.convert_py, folder, path)
            tok = tokenizer_of(path)[0]
            prompts = [tok.encode_prompt(t) for t in TEXTS]
            theirs = llama_server(a.bins, path, prompts, a.new, a.n_max, d / f"{family}-{a.mtp_init}-server")
            ref = None if a.no_reference else Reference(folder, d / f"{family}-{a.mtp_init}-ref")
            rows, replay = [], family == "qwen3_next"  # llama.cpp has no recurrent-state rollback for qwen3next
            for text, prompt, lc in zip(TEXTS, prompts, theirs):
                row = {"prompt": text, "prompt_ids": prompt, "llama.cpp": lc}
                label = f"{family} {text[:20]!r}"
                print(f"     {label}: llama.cpp draft_n {lc['draft_n']}, draft_n_accepted {lc['draft_n_accepted']}, "
                      f"rounds [anchor, accepted, drafted] {lc['rounds']}, {lc['predicted_n']} tokens "
                      f"({lc['stop_type']})", flush=True)
                check(len(lc["tokens"]) == a.new and len(lc["rounds"]) > 0 and
                      sum(r[2] for r in lc["rounds"]) == lc["draft_n"] and
                      sum(r[1] for r in lc["rounds"]) == lc["draft_n_accepted"],
                      f"{label}: llama-server decodes {a.new} tokens, its rounds sum to draft_n / draft_n_accepted")
                check(0 < lc["draft_n_accepted"] < lc["draft_n"] or a.mtp_init == "random",
                      f"{label}: some drafts accepted, not all ({lc['draft_n_accepted']}/{lc['draft_n']})")
                if ref is not None:
                    mine = ref.generate(prompt, a.new, a.n_max, replay)
                    row["reference"] = mine
                    check(mine["tokens"] == lc["tokens"] and mine["rounds"] == lc["rounds"],
                          f"{label}: the transformers reference gives llama.cpp's tokens and rounds "
                          f"(reference {mine['draft_n_accepted']}/{mine['draft_n']})")
                if not a.llama_only:
                    # qwen3next: llama.cpp replays checkpoints (and pairs a replayed anchor with a rejected row), so
                    # Strata's exact rollback is held to the reference's loop without the replay
                    want = ref.generate(prompt, a.new, a.n_max, False) if replay and ref is not None else lc
                    if replay:
                        row["reference, exact rollback"] = want
                    whose = "the reference's with an exact rollback" if replay else "llama.cpp's"
                    for where, p in (("GGUF", path), ("checkpoint", folder)):
                        ours = strata_generate(p, prompt, a.new, a.n_max)
                        row[f"strata {where}"] = ours
                        check(ours["tokens"] == lc["tokens"], f"{label} ({where}): Strata's tokens equal llama.cpp's")
                        check(ours["rounds"] == want["rounds"],
                              f"{label} ({where}): Strata's rounds (anchor, accepted, drafted) are {whose} "
                              f"({ours['draft_n_accepted']}/{ours['draft_n']} vs {want['draft_n_accepted']}/"
                              f"{want['draft_n']}; Strata's own count {ours['summary']})")
                rows.append(row)
            if a.p_min > 0 and not a.llama_only and not replay:
                report.setdefault("p_min", {})[family] = p_min_check(a, path, prompts, rows, d / f"{family}-pmin")
            report["families"][family] = rows
    if a.out:
        a.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{len(failures)} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
