"""The named shapes of random-weight targets (`--shape`): config.json fields of real models' sizes, and
tiny ones for tests. No torch import: the command line lists them."""

SHAPES = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048),
    "qwen3-4b": dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960),
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960),
    "tiny-moe": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
}
