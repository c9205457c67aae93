"""Gemma 4's assistant drafters (engine/assistant_drafter.py, engine/models/gemma4_assistant.py) for the tiny Gemma 4
of tests/parity/conftest.py ("gemma4-e": its KV-sharing layers, a window of 16): its drafts are transformers'
Gemma4AssistantCandidateGenerator's, and the tokens with them the target's alone; and Gemma 4 unified's
("gemma4-unified")."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.memory_release import release, resume, unique_storages
from engine.speculative import SpeculativeConfig
from tests.parity.conftest import decoded_from_handed_over_pages, greedy_outputs
from tests.parity.test_mtp import _first_drafts
from tests.parity.test_transformers_parity import _hf_model, _random_prompt, transformers
from tests.unit.test_memory_release import resident_bytes

WINDOW = 16


# Each kind of assistant: its target's tiny model, and transformers' classes of it (its text model's config, its own).
KINDS = {"Gemma4": ("gemma4-e", "Gemma4TextConfig", "Gemma4Assistant"),
         "Gemma4Unified": ("gemma4-unified", "Gemma4UnifiedTextConfig", "Gemma4UnifiedAssistant")}


def _assistant(path, ordered: bool, kind: str = "Gemma4"):
    """A tiny assistant for the tiny target (its KV heads, 64 wide): a sliding and a full layer, 32 wide."""
    _, text_config, assistant = KINDS[kind]
    per_layer = dict(vocab_size_per_layer_input=0, hidden_size_per_layer_input=0) if kind == "Gemma4" else {}
    text = getattr(transformers, text_config)(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        head_dim=16, global_head_dim=32, vocab_size=512, layer_types=["sliding_attention", "full_attention"],
        sliding_window=WINDOW, num_kv_shared_layers=2, initializer_range=0.2, final_logit_softcapping=None,
        **per_layer)
    torch.manual_seed(11)
    model = getattr(transformers, f"{assistant}ForCausalLM")(getattr(transformers, f"{assistant}Config")(
        text_config=text.to_dict(), backbone_hidden_size=64, use_ordered_embeddings=ordered, num_centroids=8,
        centroid_intermediate_top_k=2)).eval()
    if ordered:  # (its clusters of tokens: a permutation, as released)
        model.masked_embedding.token_ordering.copy_(torch.randperm(512, generator=torch.Generator().manual_seed(2)))
    model.save_pretrained(path)
    return model


def _transformers_drafts(target, assistant, prompt: list[int], num_drafts: int) -> tuple[list[int], torch.Tensor]:
    """Gemma4AssistantCandidateGenerator's first drafts: after the prompt and the target's first token, from the
    target's last hidden state and its KV of the prompt (each kind's last layer computing it); and the hidden state
    each draft hands the next [num_drafts, H]."""
    with torch.no_grad():
        out = target(input_ids=torch.tensor([prompt]), output_hidden_states=True, return_shared_kv_states=True)
        token = out.logits[:, -1:].argmax(dim=-1)
        hidden, shared = out.hidden_states[-1][:, -1:], out.shared_kv_states
        mask = torch.ones(1, len(prompt) + 1, dtype=torch.long)
        drafts, states = [], []
        for _ in range(num_drafts):
            embedded = target.get_input_embeddings()(token)
            drafted = assistant(inputs_embeds=torch.cat([embedded, hidden], dim=-1), attention_mask=mask,
                                position_ids=torch.tensor([[len(prompt)]]), shared_kv_states=shared, use_cache=False)
            token, hidden = drafted.logits.argmax(dim=-1), drafted.last_hidden_state
            drafts.append(int(token))
            states.append(hidden[0, 0])
    return drafts, torch.stack(states)


def _engine(target_dir, assistant_dir, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(target_dir), dtype="float32", num_kv_blocks=64, **options,
                                  speculative=SpeculativeConfig.from_dict({"model": str(assistant_dir),
                                                                           "num_speculative_tokens": 3})))


# (its logits by its LM head, or by its clusters' tokens alone; Gemma 4 unified's for its target)
@pytest.mark.parametrize("ordered, kind", [(False, "Gemma4"), (True, "Gemma4"), (True, "Gemma4Unified")])
def test_its_first_drafts_are_transformers_and_the_tokens_the_targets(tiny_model_dirs, tmp_path, ordered, kind):
    target_dir = tiny_model_dirs[KINDS[kind][0]]
    assistant = _assistant(tmp_path / "assistant", ordered, kind)
    target = _hf_model(target_dir)
    engine = _engine(target_dir, tmp_path / "assistant", max_num_batched_tokens=16)
    drafter = engine.scheduler.drafter
    for n in (9, 40):  # (40: past the sliding window)
        prompt = _random_prompt(n, 512, seed=n)
        drafts, states = _transformers_drafts(target, assistant, prompt, 3)
        assert _first_drafts(engine, prompt, f"first-{n}") == drafts, n
        seq = next(seq for seq in engine.scheduler.running if seq.request_id == f"first-{n}")
        _, ours = drafter.drafted([seq], drafter._last_hidden(seq)[None], 3)
        assert (ours[:, 0] - states).abs().max().item() < 1e-4, n
        engine.abort(f"first-{n}")
    prompts = {f"p{n}": (_random_prompt(n, 512, seed=100 + n), {}) for n in (5, 23, 31)}
    expected = {name: target.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
                for name, (p, _) in prompts.items()}
    outputs = greedy_outputs(engine, prompts, 12)
    assert {name: outputs[name] for name in prompts} == expected
    engine.close()


def test_an_assistant_for_another_target_is_refused(tiny_model_dirs, tmp_path):
    _assistant(tmp_path / "assistant", ordered=False)
    with pytest.raises(ValueError, match="drafts for a Gemma 4 target"):
        _engine(tiny_model_dirs["llama-gqa-untied"], tmp_path / "assistant")
    with pytest.raises(ValueError, match="KV heads"):
        _engine(tiny_model_dirs["gemma4-k-eq-v"], tmp_path / "assistant")


def test_a_decode_worker_drafts_with_it_from_the_pages_a_prefill_worker_handed_over(tiny_model_dirs, tmp_path):
    """Both workers with the assistant: the prefill worker hands no drafts over (it keeps no KV to hand), the decode
    worker drafts once its first step has computed a hidden state of its own; the tokens are the target's."""
    target_dir = tiny_model_dirs["gemma4-e"]
    _assistant(tmp_path / "assistant", ordered=False)
    prefill = _engine(target_dir, tmp_path / "assistant", max_num_batched_tokens=16)
    decode = _engine(target_dir, tmp_path / "assistant")
    prompts = {f"r{n}": _random_prompt(n, 512, seed=200 + n) for n in (6, 37)}
    outputs = decoded_from_handed_over_pages(prefill, decode, {name: (p, 10, {}, {}) for name, p in prompts.items()})
    target = _hf_model(target_dir)
    for name, prompt in prompts.items():
        expected = target.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt):]
        assert outputs[name].token_ids == expected.tolist(), name
    assert decode.scheduler.drafting.num_draft_tokens > 0  # (it drafted)
    prefill.close()
    decode.close()


def test_sleep_mode_gives_back_its_weights_too_and_wakes_it_drafting_as_before(tiny_model_dirs, tmp_path):
    """vLLM's sleep and wake_up: the assistant's weights leave the process with the target's, and come back from its
    own checkpoint: the same drafts as before."""
    assistant = _assistant(tmp_path / "assistant", ordered=False)
    engine = _engine(tiny_model_dirs["gemma4-e"], tmp_path / "assistant", max_num_batched_tokens=16)
    prompt = _random_prompt(30, 512, seed=7)
    awake = _first_drafts(engine, prompt, "awake")
    assert awake == _transformers_drafts(_hf_model(tiny_model_dirs["gemma4-e"]), assistant, prompt, 3)[0]
    engine.abort("awake")
    while engine.has_unfinished_requests():
        engine.step()
    assistant_weights = unique_storages(engine.scheduler.drafter.runner.model.parameters())
    release(engine, ["weights", "kv_cache"])
    assert sum(resident_bytes(w) for w in assistant_weights) == 0
    resume(engine, ["weights", "kv_cache"])
    assert _first_drafts(engine, prompt, "woken") == awake
    engine.close()
