"""llama.cpp's tensor names for the Llama-lineage layers, beside their Hugging Face names: one table that
the target loader and the DFlash contract both read (as gguf-py keeps a format's constants in one place)."""

#: Hugging Face name under a layer (layers.N. / model.layers.N.) -> llama.cpp name under blk.N.
LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "mlp.gate.weight": "ffn_gate_inp.weight",  # a mixture-of-experts router
}
#: a mixture-of-experts layer's stacked experts, llama.cpp's 3-D tensors under blk.N.
EXPERTS = {"gate": "ffn_gate_exps.weight", "up": "ffn_up_exps.weight", "down": "ffn_down_exps.weight"}
#: a target's tensors outside the layers
TARGET = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
ROPE_FACTORS = "rope_freqs.weight"  # Llama 3.1+: the per-frequency divisors of its RoPE scaling


def target_name(hf: str) -> str:
    """A transformers checkpoint name of a dense target as llama.cpp names it."""
    if hf in TARGET:
        return TARGET[hf]
    _, _, n, rest = hf.split(".", 3)  # model.layers.N.rest
    return f"blk.{n}.{LAYER[rest]}"
#: the hybrids' (llama.cpp's qwen35, qwen35moe, qwen3next) layer tensors under blk.N.: a full-attention layer's
#: norms, a gated DeltaNet layer's parts, a shared expert's
HYBRID = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "in_proj_qkv": "attn_qkv.weight",
    "in_proj_z": "attn_gate.weight",
    "in_proj_b": "ssm_beta.weight",
    "in_proj_a": "ssm_alpha.weight",
    "in_proj_ba": "ssm_ba.weight",  # qwen3next: b and a of each key head's group together
    "conv1d": "ssm_conv1d.weight",
    "dt_bias": "ssm_dt.bias",
    "A": "ssm_a",  # -exp(A_log), no .weight
    "norm": "ssm_norm.weight",
    "out_proj": "ssm_out.weight",
    "shared_gate": "ffn_gate_shexp.weight",
    "shared_up": "ffn_up_shexp.weight",
    "shared_down": "ffn_down_shexp.weight",
    "shared_router": "ffn_gate_inp_shexp.weight",
}


def nextn_layer(name: str, layers: int) -> int | None:
    """The block of a tensor past a target's `layers` (an MTP block: `{arch}.nextn_predict_layers` of them
    follow the decoder's), else None."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) >= layers:
        return int(parts[1])
    return None
