"""The expert cache of a mixture-of-experts target: which experts live on its device and which in host
memory, run by the CPU.

The budget is `--expert-cache MIB` (0: every expert on the CPU), or by default what the device has left
once the other weights, the KV cache, a workspace and the drafter are counted. It is split evenly over
the sparse layers (the earlier layers take the remainder). Which experts a layer keeps: its
lowest-numbered ones (static, so a pinned budget always gives the same placement), or, placed by
"prefill", those its rows chose most in the first prompt's prefill (a real router's choices are skewed,
so more of a token's experts are then on the device). A GGUF file's quantized experts stay in their
blocks on the device, so the budget holds as many as the file's bytes allow; those in host memory are
dequantized there, as the CPU runs them with torch. On the CPU the device is the CPU, so only an
explicit budget splits anything (the tests exercise the host path that way)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..layers.moe import SparseMoE

GIB = 1 << 30
MIB = 1 << 20
WORKSPACE = 2 * GIB  # activations, logits, CUDA graphs' pools, allocator slack
PLACEMENTS = ("static", "prefill")


@dataclass
class ExpertPlan:
    experts: int  # per sparse layer
    expert_bytes: int  # one expert's three matrices
    resident: list[int]  # experts kept on the device, per sparse layer
    device: str
    budget: int  # bytes the device may give the experts
    arithmetic: list[str] = field(default_factory=list)  # how the budget was reached
    by: str = "static"  # which experts stay: PLACEMENTS
    quantized: bool = False  # the device's experts stay in their GGUF blocks (layers/quant.QuantExperts)
    host_expert_bytes: int = 0  # one expert as host memory keeps it
    host_in_blocks: bool = False  # quantized experts stay in their blocks in host memory too (SparseMoE.host_in_blocks)
    moved: int | None = None  # "prefill": experts the first prefill's routing moved onto the device (None: not yet)

    @property
    def total(self) -> int:
        return self.experts * len(self.resident)

    @property
    def on_device(self) -> int:
        return sum(self.resident)

    def report(self) -> str:
        """The placement and its budget arithmetic, a few lines for stderr."""
        all_bytes = self.total * self.expert_bytes
        lines = [f"experts: {len(self.resident)} sparse layers x {self.experts} experts x "
                 f"{self.expert_bytes / MIB:.2f} MiB = {size(all_bytes)}"
                 + (" (in their GGUF blocks)" if self.quantized else "")]
        lines += [f"  {line}" for line in self.arithmetic]
        host = self.total - self.on_device
        share = 100 * self.on_device / self.total if self.total else 100.0
        share = min(max(share, 1), 99) if 0 < self.on_device < self.total else share  # never 0% or 100% of a split
        form = ", in their GGUF blocks" if self.host_in_blocks else ", dequantized" if self.quantized else ""
        threads = torch.get_num_threads()
        lines.append(f"  on the device ({self.device}): {self.on_device} ({share:.0f}%, "
                     f"{size(self.on_device * self.expert_bytes)}); in host memory, run by the CPU with "
                     f"{threads} thread{'s' if threads != 1 else ''}: {host} "
                     f"({size(host * self.host_expert_bytes)}{form})")
        if self.by == "prefill" and host and self.on_device:
            lines.append("  which: those each layer's rows choose most in the first prompt's prefill" +
                         ("" if self.moved is None else f" ({self.moved} experts moved onto the device)"))
        elif host and self.on_device:
            lines.append("  which: each layer's lowest-numbered experts (static)")
        return "\n".join(lines)


def size(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.1f} MiB"


def sparse_layers(model) -> list[SparseMoE]:
    return [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE)]


def plan_experts(model, device, cache_mib: int | None, max_len: int, drafter_bytes: int = 0,
                 by: str = "static") -> ExpertPlan | None:
    """The placement of a model whose experts still sit in host memory (None: it has none). cache_mib None:
    the automatic budget, which on a CPU device keeps every expert in place. by: PLACEMENTS."""
    moes = sparse_layers(model)
    if not moes:
        return None
    moe = moes[0]
    expert_bytes = max(m.expert_bytes for m in moes)  # a Q4_K_M file gives some layers' down experts more bits
    total = moe.experts * len(moes)
    device = torch.device(device)
    if cache_mib is not None:
        budget, arithmetic = cache_mib * MIB, [f"--expert-cache {cache_mib} MiB"]
    elif device.type != "cuda":
        budget, arithmetic = total * expert_bytes, [f"auto on {device.type}: every expert stays in place"]
    else:
        budget, arithmetic = auto_budget(model, moes, device, max_len, drafter_bytes)
    count = min(total, max(0, budget) // expert_bytes)
    share, extra = divmod(count, len(moes))
    resident = [min(moe.experts, share + (i < extra)) for i in range(len(moes))]
    return ExpertPlan(moe.experts, expert_bytes, resident, device.type, budget, arithmetic, by, moe.quantized,
                      max(m.host_expert_bytes for m in moes), all(m.host_in_blocks for m in moes))


def auto_budget(model, moes, device, max_len: int, drafter_bytes: int) -> tuple[int, list[str]]:
    """What the GPU has free now, less the weights that are not experts, the KV cache of max_len
    positions, the drafter and a workspace: the bytes left for experts, and the arithmetic."""
    cfg = model.cfg
    free = torch.cuda.mem_get_info(device)[0]
    experts = {id(p) for moe in moes for p in (moe.gate_up_proj, moe.down_proj)}
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in experts)
    attention_layers = cfg.num_layers - (len(cfg.linear.layers) if cfg.linear is not None else 0)
    attention_layers += model.mtp is not None  # an MTP block's K/V (its weights are counted above)
    kv = 2 * attention_layers * (max_len + 64) * cfg.num_kv_heads * cfg.head_dim * model.norm.weight.element_size()
    budget = free - weights - kv - drafter_bytes - WORKSPACE
    return budget, [f"auto: {free / GIB:.2f} GiB free on {device} - {weights / GIB:.2f} GiB other weights - "
                    f"{kv / GIB:.2f} GiB KV cache ({max_len} positions) - {drafter_bytes / GIB:.2f} GiB drafter - "
                    f"{WORKSPACE / GIB:.2f} GiB workspace = {max(budget, 0) / GIB:.2f} GiB for experts"]


def place_experts(model, device, cache_mib: int | None, max_len: int, drafter_bytes: int = 0,
                  by: str = "static") -> None:
    """Plan the placement (plan_experts) and apply it: each sparse layer keeps its planned experts, the rest
    go to host memory (pinned when a GPU will copy from it; quantized ones in their blocks, or dequantized
    on the device on their way where the CPU's kernels lack their type); the plan stays as
    model.expert_plan. Placed by "prefill", the lowest-numbered experts stay until place_by_routing moves
    them."""
    plan = plan_experts(model, device, cache_mib, max_len, drafter_bytes, by)
    model.expert_plan = plan
    if plan is not None:
        for moe, keep in zip(sparse_layers(model), plan.resident):
            moe.place(list(range(keep)), pin=plan.device == "cuda", dequantize_on=torch.device(device),
                      keep_blocks=by == "prefill", count=by == "prefill")


def place_by_routing(model) -> None:
    """After the first prefill of a model placed by "prefill": each sparse layer keeps on the device the
    experts its rows chose most in that prefill (SparseMoE.counts; ties: those already there, then the
    lower ids), their weights swapped with host memory in place, once. Placement never changes the
    output; it only decides which device computes an expert."""
    plan = getattr(model, "expert_plan", None)
    if plan is None or plan.by != "prefill" or plan.moved is not None:
        return
    moved = 0
    for moe, keep in zip(sparse_layers(model), plan.resident):
        if moe.host_experts and keep:
            rank = sorted(range(moe.experts), key=lambda e: (-int(moe.counts[e]), moe.slot[e] < 0, e))
            moved += moe.replace(rank[:keep])
        moe.counting = False
    plan.moved = moved
