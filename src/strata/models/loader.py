"""Loading a target: a Hugging Face folder (config.json + safetensors, single or sharded) read through
its family, with the checkpoint's tensors packed into the modules' fused parameters."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import StrataError
from . import mtp as mtp_block
from .config import ModelConfig, read_json
from .registry import Family, family_for

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: what a checkpoint's tensors may hold; other dtypes (int8, int32, bool, FP8 without its scales) are another
#: format's and would decode garbage if cast
FLOAT_DTYPES = tuple(DTYPES.values())


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise StrataError(f"--dtype: expected one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise StrataError(f"{index}: not a valid safetensors index ({e})") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise StrataError(f"{index}: names shard {f.name}, which does not exist")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(folder.glob("*.safetensors"))
    if found:
        return found
    raise StrataError(f"{folder}: no model.safetensors or model.safetensors.index.json")


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder, in their stored dtype, on the CPU."""
    tensors: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise StrataError(f"{path}: cannot read safetensors ({e})") from None
    return tensors


def checkpoint_shapes(layout: dict[str, list[tuple[str, tuple]]]) -> dict[str, tuple]:
    """Checkpoint tensor name -> shape, in layout order."""
    return {name: shape for sources in layout.values() for name, shape in sources}


def pack(tensors: dict[str, torch.Tensor], layout: dict[str, list[tuple[str, tuple]]], dtype: torch.dtype,
         source) -> dict[str, torch.Tensor]:
    """Parameters from checkpoint tensors: each named source checked for presence and shape, converted
    to dtype, and concatenated (q/k/v, gate/up) where a parameter has several."""
    state = {}
    for param, sources in layout.items():
        parts = []
        for name, shape in sources:
            t = tensors.get(name)
            if t is None:
                raise StrataError(f"{source}: missing tensor '{name}' (expected shape {list(shape)})")
            if tuple(t.shape) != tuple(shape):
                raise StrataError(f"{source}: tensor '{name}' has shape {list(t.shape)}, expected {list(shape)}")
            if t.dtype not in FLOAT_DTYPES:
                raise StrataError(f"{source}: tensor '{name}' has dtype {dtype_name(t.dtype)}, expected float32, "
                                  f"bfloat16 or float16 (quantized checkpoints load with their quantization_config: "
                                  f"block-scaled FP8; or as GGUF files)")
            parts.append(t.to(dtype))
        state[param] = parts[0] if len(parts) == 1 else torch.cat(parts)
    return state


def unpack(state: dict[str, torch.Tensor], layout: dict[str, list[tuple[str, tuple]]]) -> dict[str, torch.Tensor]:
    """The inverse of pack: checkpoint tensors (views of the parameters) by their names."""
    out = {}
    for param, sources in layout.items():
        offset = 0
        rows = state[param].reshape(-1, *sources[0][1][1:])  # stacked experts: their matrices' rows
        for name, shape in sources:
            out[name] = rows[offset:offset + shape[0]].reshape(shape)
            offset += shape[0]
    return out


def load_model_config(folder: str | Path) -> tuple[Family, ModelConfig]:
    """The family and hyper-parameters of a model folder or GGUF file, without its weights."""
    folder = Path(folder)
    if folder.is_file():
        return gguf_model(folder)[:2]
    if not folder.is_dir():
        from ..files import kind_of

        found = f"is {kind_of(folder.stat().st_mode)}" if folder.exists() else "no such file or folder"
        raise StrataError(f"{folder}: {found} (expected a model folder or GGUF file)")
    path = folder / "config.json"
    hf = read_json(path, "config.json")
    fam = family_for(hf, path)
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
    held = checkpoint_counts(folder)  # before anything of as many layers or experts as config.json says is built
    layers = text.get("num_hidden_layers")
    if held is not None and isinstance(layers, int) and layers > held[0]:
        raise StrataError(f"{path}: num_hidden_layers is {layers}, but the checkpoint holds {held[0]} layers")
    cfg = fam.config(hf, path)
    cfg.weight_block = weight_block(hf, path)
    if held is not None and cfg.moe is not None and held[1] and cfg.moe.experts > held[1]:
        raise StrataError(f"{path}: num_experts is {cfg.moe.experts}, but the checkpoint holds {held[1]} experts a "
                          f"layer")
    if held is not None and cfg.linear is not None:
        # the MTP blocks the tensors hold: Qwen3-Next's config does not count them, and a re-upload may keep the
        # count but drop the tensors
        cfg.mtp_layers = min(cfg.mtp_layers, held[2]) if "mtp_num_hidden_layers" in text else held[2]
    return fam, cfg


def weight_block(hf: dict, path: Path) -> tuple[int, int] | None:
    """A config.json's quantization_config: None without one, the [rows, cols] block of a block-scaled FP8
    checkpoint (Qwen's and DeepSeek's: e4m3 weights, each block times its weight_scale_inv), refused
    otherwise."""
    qc = hf.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method != "fp8":
        raise StrataError(f"{path}: quantization_config.quant_method {method!r} is not supported (Strata loads "
                          f"unquantized checkpoints, block-scaled FP8 ('fp8' with weight_block_size), and GGUF files)")
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise StrataError(f"{path}: quantization_config.weight_block_size must be [rows, cols] (block-scaled FP8; "
                          f"per-tensor or per-channel FP8 is not supported), got {block!r}")
    for key, want in (("fmt", "e4m3"), ("activation_scheme", "dynamic")):
        if qc.get(key, want) != want:
            raise StrataError(f"{path}: quantization_config.{key} {qc[key]!r} is not supported (expected {want!r})")
    return block[0], block[1]


def dequantize_fp8(tensors: dict[str, torch.Tensor], block: tuple[int, int] | None, source) -> dict:
    """A block-scaled FP8 checkpoint's tensors with each e4m3 weight multiplied out by its weight_scale_inv
    (one float per [rows, cols] block, the last blocks partial), in float32; the scales consumed. Tensors
    the checkpoint left unquantized pass as they are."""
    if block is None:
        return tensors
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            if name.removesuffix("_scale_inv") not in tensors:
                raise StrataError(f"{source}: tensor '{name}' scales no tensor of the checkpoint")
            continue
        scale = tensors.get(name + "_scale_inv")
        if t.dtype != torch.float8_e4m3fn:
            if scale is not None:
                raise StrataError(f"{source}: tensor '{name}' has a weight_scale_inv but dtype {dtype_name(t.dtype)}, "
                                  f"expected float8_e4m3fn")
            out[name] = t
            continue
        if scale is None:
            raise StrataError(f"{source}: FP8 tensor '{name}' has no '{name}_scale_inv'")
        grid = tuple(-(-n // b) for n, b in zip(t.shape, block)) if t.dim() == 2 else None
        if grid is None or tuple(scale.shape) != grid or scale.dtype not in FLOAT_DTYPES:
            raise StrataError(f"{source}: tensor '{name}_scale_inv' has shape {list(scale.shape)} and dtype "
                              f"{dtype_name(scale.dtype)}, expected float scales of shape {list(grid or [])} "
                              f"(one per {block[0]}x{block[1]} block of a 2-D weight)")
        rows, cols = t.shape
        expanded = scale.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
        out[name] = t.float() * expanded
    return out


def checkpoint_counts(folder: Path) -> tuple[int, int, int] | None:
    """How many decoder layers, experts a layer (0: none by index) and MTP blocks (mtp.layers.N) a checkpoint's
    tensor names cover (its safetensors headers only; None without weights)."""
    try:
        files = safetensors_files(folder)
    except StrataError:
        return None
    layers, experts, mtp = set(), set(), set()
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    for found, pattern in ((layers, r"^(?!mtp\.).*\.layers\.(\d+)\."),
                                           (experts, r"\.experts\.(\d+)\."), (mtp, r"^mtp\.layers\.(\d+)\.")):
                        m = re.search(pattern, name)
                        if m:
                            found.add(int(m.group(1)))
        except (SafetensorError, OSError, RuntimeError) as e:
            raise StrataError(f"{path}: cannot read safetensors ({e})") from None
    return len(layers), len(experts), len(mtp)


def instantiate(fam: Family, cfg: ModelConfig, state: dict[str, torch.Tensor], device,
                quant: dict | None = None, place=None) -> torch.nn.Module:
    """The family's modules built without memory, the state assigned, quantized matrices (QuantWeights,
    already on the device; QuantExperts, moved after the placement) put in place of their parameters,
    moved to the device, frozen. place(model): runs before the move (an expert cache keeps some experts
    in host memory)."""
    from ..layers.quant import QuantExperts, replace_parameter

    quant = dict(quant or {})
    if cfg.tie_word_embeddings:
        state = {**state, "lm_head.weight": state["embed_tokens.weight"]}
        if "embed_tokens.weight" in quant:
            quant["lm_head.weight"] = quant["embed_tokens.weight"]
    with torch.device("meta"):
        model = fam.build(cfg)
    shapes = {name: p.shape for name, p in model.state_dict().items()}
    state = {name: t.reshape(shapes[name]) if name in shapes and t.shape != shapes[name]
             and t.numel() == shapes[name].numel() else t for name, t in state.items()}  # stacked experts
    model.load_state_dict(state, assign=True, strict=True)
    for name, weight in quant.items():
        replace_parameter(model, name, weight)
    model.tie_weights_()
    if place is not None:
        place(model)
    model = model.to(device)
    for module in model.modules():  # quantized experts the placement kept whole (no tensors: .to skips them)
        for attr, value in list(vars(module).items()):
            if isinstance(value, QuantExperts):
                setattr(module, attr, value.to(device))
    return model.eval().requires_grad_(False)


def load_target(path: str | Path, device="cpu", dtype: torch.dtype = torch.float32, quantized: bool | None = None,
                place=None, model_config: tuple[Family, ModelConfig] | None = None, mtp: bool = False):
    """A Hugging Face folder, or a llama.cpp GGUF file. Its quantized matrices stay quantized on a GPU
    (or with quantized=True: the Triton kernels then run, in the interpreter on the CPU) and are
    dequantized at load on the CPU. place: see instantiate. model_config: a folder's load_model_config,
    where the caller already read it (a GGUF file's metadata is read once in any case: gguf_file.read).
    mtp: with the model's MTP block (models/mtp.py), refused where it has none."""
    path = Path(path)
    if path.is_file():
        return load_gguf_target(path, device, dtype, torch.device(device).type == "cuda" if quantized is None
                                else quantized, place, mtp)
    fam, cfg = model_config or load_model_config(path)
    if mtp:
        cfg = mtp_block.loading(cfg, path)
    tensors = dequantize_fp8(read_safetensors(path), cfg.weight_block, path)
    state = fam.finish(pack(tensors, mtp_block.with_block(fam.hf_layout(cfg), cfg, gguf=False), dtype, path), cfg)
    return instantiate(fam, cfg, state, device, place=place)


def check_tensors(model: torch.nn.Module, where) -> None:
    """--check-tensors (llama.cpp's name): every weight of a loaded model finite, its quantized matrices'
    block scales included, or a one-line error naming the first one that is not."""
    from ..layers.quant import QuantExperts, QuantWeight, non_finite_blocks

    for name, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        bad = sum(int((~torch.isfinite(flat[i:i + (1 << 24)])).sum()) for i in range(0, flat.numel(), 1 << 24))
        if bad:
            raise StrataError(f"{where}: --check-tensors: tensor '{name}' holds {bad} non-finite values (NaN or inf) "
                              f"of {p.numel()}")
    for path, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, QuantWeight):
                bad = sum(non_finite_blocks(s.qtype, s.data) for s in value.segments)
            elif isinstance(value, QuantExperts):
                bad = non_finite_blocks(value.qtype, value.data)
            else:
                continue
            if bad:
                raise StrataError(f"{where}: --check-tensors: tensor '{path}.{attr}' holds {bad} quantized blocks "
                                  f"whose scales are not finite (NaN or inf)")


def gguf_model(path: Path):
    """(family, config, metadata, tensor table) of a GGUF target, or a one-line error."""
    from .. import gguf_file
    from .registry import family_for_gguf

    kv, infos = gguf_file.read(path)
    tensors = {i.name: i for i in infos}
    fam = family_for_gguf(kv.get("general.architecture"), path)
    return fam, fam.gguf_config(kv, tensors, str(path)), kv, tensors


def stored_shape(info, shape: tuple) -> tuple:
    """The shape a layout expects, or the file's where it differs only by dimensions of 1 (a [1, n] matrix
    that llama-quantize writes as an [n] vector)."""
    stored = tuple(reversed(info.shape))
    squeeze = lambda s: tuple(d for d in s if d != 1)  # noqa: E731
    return stored if stored != shape and squeeze(stored) == squeeze(shape) else shape


#: what llama.cpp's converter writes as one tensor with --fuse-qkv and --fuse-gate-up-exps: the parts' matrices
#: stacked along their rows (a 3-D expert tensor: each expert's gate rows, then its up rows)
FUSED = {("attn_q", "attn_k", "attn_v"): "attn_qkv", ("ffn_gate_exps", "ffn_up_exps"): "ffn_gate_up_exps"}


def with_fused(layout: dict, tensors: dict) -> dict:
    """The layout with the fused tensors a file holds in place of their parts: one source of their shape, whose
    transform splits it into the parts (each part's own transform applied) and stacks them as the parts' sources
    are stacked (along the first dimension). A fused 3-D expert tensor in blocks is already each expert's gate
    then up rows, as quantized_experts stacks the parts; only its float values are regrouped."""
    out = dict(layout)
    for param, sources in layout.items():
        for parts, fused in FUSED.items():
            if len(sources) != len(parts):
                continue
            heads = [name.rsplit(".", 2) for name, *_ in sources]  # blk.N.attn_q.weight -> blk.N, attn_q, weight
            if any(len(h) != 3 or h[1] != part or (h[0], h[2]) != (heads[0][0], heads[0][2])
                   for h, part in zip(heads, parts)):
                continue
            name = f"{heads[0][0]}.{fused}.{heads[0][2]}"
            if name not in tensors or any(n in tensors for n, *_ in sources):
                continue
            shapes = [s for _, s, _ in sources]
            axis = len(shapes[0]) - 2 if len(shapes[0]) > 1 else 0
            sizes = [s[axis] for s in shapes]
            shape = (*shapes[0][:axis], sum(sizes), *shapes[0][axis + 1:])
            transforms = [t for *_, t in sources]

            def split(t, sizes=sizes, transforms=transforms, axis=axis):
                return torch.cat([tr(p) if tr else p for p, tr in zip(torch.split(t, sizes, dim=axis), transforms)])

            out[param] = [(name, shape, split)]
    return out


def load_gguf_target(path: Path, device="cpu", dtype: torch.dtype = torch.float32, quantized: bool = False,
                     place=None, mtp: bool = False):
    from .. import gguf_file
    from ..errors import ArtifactError
    from ..gguf_names import ROPE_FACTORS, nextn_layer
    from ..layers.quant import QuantWeight

    try:
        fam, cfg, _, tensors = gguf_model(path)
        if mtp:
            cfg = mtp_block.loading(cfg, path)
        layout = with_fused(mtp_block.with_block(fam.gguf_layout(cfg), cfg, gguf=True), tensors)
        known = {name for sources in layout.values() for name, *_ in sources} | {ROPE_FACTORS}
        unknown = sorted(n for n in set(tensors) - known if mtp or nextn_layer(n, cfg.num_layers) is None)
        if unknown:
            raise StrataError(f"{path}: unexpected tensors {', '.join(unknown[:6])}{' ...' if len(unknown) > 6 else ''} "
                              f"(a {fam.gguf_arch} file with parts Strata does not implement)")
        state, quant, dequantized = {}, {}, {}

        def values(sources):
            parts = []
            for name, shape, transform in sources:
                t = gguf_file.values(tensors[name], stored_shape(tensors[name], shape), str(path)).reshape(shape)
                parts.append((transform(t.float()) if transform else t).to(dtype))
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        for param, sources in layout.items():
            missing = [name for name, *_ in sources if name not in tensors]
            if missing:
                shape = next(s for n, s, _ in sources if n == missing[0])
                raise StrataError(f"{path}: missing tensor '{missing[0]}' (expected shape {list(shape)})")
            if quantized and layer_experts_in_blocks(param, layout, tensors):
                quant[param] = experts = quantized_experts(sources, tensors, dtype)
                state[param] = torch.empty(experts.shape, device="meta", dtype=dtype)
                continue
            if quantized and all(QuantWeight.fits(tensors[n].type, s) and tuple(reversed(tensors[n].shape)) == s
                                 for n, s, _ in sources):
                parts = [(int(tensors[n].type), gguf_file.rows_of_blocks(tensors[n], s)) for n, s, _ in sources]
                parts = [(t, tr(raw) if tr else raw) for (t, raw), (_, _, tr) in zip(parts, sources)]
                quant[param] = quantized_weight(parts, sources[0][1][1], device, dtype)
                state[param] = torch.empty(sum(raw.shape[0] for _, raw in parts), sources[0][1][1], device="meta",
                                           dtype=dtype)
                continue
            state[param] = values(sources)
            matrices = {n: (tensors[n].type.name, math.prod(s) * state[param].element_size())
                        for n, s, _ in sources if len(s) > 1}
            if quantized and any(kind not in ("F32", "F16", "BF16") for kind, _ in matrices.values()):
                dequantized.update(matrices)
    except ArtifactError as e:
        raise StrataError(str(e)) from None
    model = instantiate(fam, cfg, state, device, quant, place)
    model.dequantized = dequantized
    return model


def dequantized_report(model, where) -> str | None:
    """One line on the quantized tensors that run as floats (types the device kernels do not take, or rows
    that are not whole 256-value tiles): how many, of which types, and the bytes that costs."""
    found = model.dequantized
    if not found:
        return None
    names = [f"{n} ({kind})" for n, (kind, _) in sorted(found.items())]
    kinds = sorted({kind for kind, _ in found.values()})
    return (f"{where}: {len(names)} tensors of types the device kernels do not take ({', '.join(kinds)}; "
            f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''}) run dequantized to "
            f"{str(model.norm.weight.dtype).removeprefix('torch.')}: "
            f"{sum(nbytes for _, nbytes in found.values()) / 2 ** 30:.2f} GiB")


#: a sparse layer's two expert parameters, each the other's pair
EXPERT_PAIRS = {"gate_up_proj": "down_proj", "down_proj": "gate_up_proj"}


def layer_experts_in_blocks(param: str, layout: dict, tensors: dict) -> bool:
    """Whether `param` is a sparse layer's experts kept in their blocks (quantized_experts): only when both
    of the layer's expert parameters can be, since a layer's experts run one way."""
    head, _, tail = param.rpartition(".")
    pair = f"{head}.{EXPERT_PAIRS[tail]}" if tail in EXPERT_PAIRS else None
    return pair in layout and all(experts_in_blocks(layout[p], tensors) for p in (param, pair))


def experts_in_blocks(sources: list[tuple], tensors: dict) -> bool:
    """Whether an expert parameter's sources are 3-D tensors of one type the kernels take, in the file."""
    from ..layers.quant import QuantExperts

    if any(name not in tensors for name, *_ in sources):
        return False
    infos = [tensors[name] for name, *_ in sources]
    shapes = [shape for _, shape, _ in sources]
    return all(len(s) == 3 and tuple(reversed(i.shape)) == s for i, s in zip(infos, shapes)) and \
        len({int(i.type) for i in infos}) == 1 and QuantExperts.fits(int(infos[0].type), shapes[0][2])


def quantized_experts(sources: list[tuple], tensors: dict, dtype):
    """A sparse layer's 3-D expert tensors ([E, rows, cols] each; gate and up stacked per expert) as
    QuantExperts in host memory (where experts_in_blocks). They move to the device once the expert cache
    has placed them (instantiate)."""
    from .. import gguf_file
    from ..layers.quant import QuantExperts

    infos = [tensors[name] for name, *_ in sources]
    shapes = [shape for _, shape, _ in sources]
    e = shapes[0][0]
    blocks = [gguf_file.rows_of_blocks(i, (e * s[1], s[2])).view(e, s[1], -1) for i, s in zip(infos, shapes)]
    return QuantExperts(int(infos[0].type), torch.cat(blocks, dim=1), shapes[0][2], dtype)


def quantized_weight(parts: list[tuple[int, torch.Tensor]], cols: int, device, dtype):
    """A parameter's GGUF blocks on the device: its sources' (type, uint8 rows) in order, runs of one type
    joined into one segment."""
    from ..layers.quant import QuantWeight, Segment

    segments = []
    for qtype, raw in parts:
        if segments and segments[-1].qtype == qtype:
            segments[-1] = Segment(qtype, torch.cat([segments[-1].data, raw]))
        else:
            segments.append(Segment(qtype, raw))
    return QuantWeight([Segment(s.qtype, s.data.to(device)) for s in segments], cols, dtype)
