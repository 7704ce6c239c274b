"""Every model family against the Family protocol: its methods' signatures, its layouts against the modules
it builds, and its transformers peer (the bench's reference) decoding as Strata does."""

from __future__ import annotations

import inspect

import pytest
import torch

from strata.bench.peer import PEERS
from strata.bench.run import hf_generate
from strata.engine.decode import Engine
from strata.models.loader import load_target
from strata.models.registry import Family, families

from conftest import hf_config, write_hf_model

FAMILIES = sorted(families())


def test_every_family_implements_the_protocol_with_its_signatures_and_names_a_peer():
    methods = [name for name, member in vars(Family).items() if inspect.isfunction(member) and name[0] != "_"]
    assert {"config", "build", "hf_layout", "finish", "gguf_config", "gguf_layout"} <= set(methods)
    for name, fam in families().items():
        assert isinstance(fam, Family) and fam.name == name
        for method in methods:
            want = list(inspect.signature(getattr(Family, method)).parameters)[1:]
            assert list(inspect.signature(getattr(fam, method)).parameters) == want, (name, method)
    assert set(PEERS) == set(families())  # a new family says whether transformers can be its peer


@pytest.mark.parametrize("name", FAMILIES)
def test_layouts_name_every_parameter_the_family_builds(name):
    fam = families()[name]
    cfg = fam.config(hf_config(name).to_dict(), "<test>")
    with torch.device("meta"):
        built = set(fam.build(cfg).state_dict())
    assert set(fam.hf_layout(cfg)) == built - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    if fam.gguf_arch:
        assert set(fam.gguf_layout(cfg)) == set(fam.hf_layout(cfg))


def test_the_hybrid_moe_peer_decodes_as_strata_does(tmp_path):
    """Qwen3.5-MoE's transformers peer takes the hybrid's checkpoint conversion and the stacked experts."""
    path, _ = write_hf_model(tmp_path / "m", "qwen3_5_moe", seed=4, layers=4)  # layer 3 attends
    target = load_target(path)
    prompt = [3, 17, 99, 4]
    got = hf_generate(target, prompt, 12, ["eager"], 1)
    assert got["eager"]["output_ids"] == Engine(target).generate(prompt, 12).output_ids, got
