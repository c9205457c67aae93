"""Speculative decoding with EAGLE heads (engine/eagle.py, engine/models/eagle.py), vLLM's `{"method": "eagle"}`
and `{"method": "eagle3"}`: the tokens are plain decoding's whatever the head drafts; the head's drafts are those
of its architecture computed by transformers' own layers from transformers' hidden states of the target; a head
that computes its target has most of its drafts taken; a decode engine handed a prompt's pages drafts from its
first token on; heads that cannot draft for the target are refused."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from engine.config import EngineConfig
from engine.demo_model import make_demo_model
from engine.llm_engine import LLMEngine
from engine.memory_release import release, resume, unique_storages
from engine.sampling_params import SamplingParams
from engine.speculative import SpeculativeConfig
from tests.draft_models import eagle_head, eagle_replica
from tests.unit.test_disaggregation import assert_clean, finish
from tests.unit.test_draft_model import _run
from tests.unit.test_memory_release import resident_bytes
from tests.unit.test_speculative import assert_same_outputs

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
LAYERS = [0, 1, 3]  # the target's layers whose inputs the EAGLE-3 heads read
METHODS = {"eagle": "eagle", "eagle3": "eagle3", "eagle3-whole-vocabulary": "eagle3",
           "eagle3-last-hidden-state": "eagle3"}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """Four layers, so that an EAGLE-3 head reads three distinct layers' inputs."""
    return make_demo_model(tmp_path_factory.mktemp("eagle") / "target", hidden_size=64, num_layers=4, num_heads=4,
                           num_kv_heads=2, vocab_size=1024, seed=1)


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    return {"eagle": eagle_head(target, root / "eagle", "eagle"),
            # its own LM head over 256 of the target's tokens, d2t mapping them
            "eagle3": eagle_head(target, root / "eagle3", "eagle3", draft_vocab_size=256, target_layers=LAYERS),
            # the target's embeddings and LM head
            "eagle3-whole-vocabulary": eagle_head(target, root / "eagle3-whole", "eagle3", seed=2,
                                                  target_layers=LAYERS),
            # eagle_config's use_aux_hidden_state false: the target's last hidden states, no fc
            "eagle3-last-hidden-state": eagle_head(target, root / "eagle3-last", "eagle3", seed=3,
                                                   reads_last_hidden_state=True)}


def _config(head_dir, method: str = "eagle3", num_speculative_tokens: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig.from_dict({"method": method, "model": str(head_dir),
                                        "num_speculative_tokens": num_speculative_tokens})


@pytest.mark.parametrize("head", ["eagle", "eagle3", "eagle3-whole-vocabulary"])
@pytest.mark.parametrize("engine_options", [pytest.param({}, id="roomy"),
                                            pytest.param({"max_num_batched_tokens": 16}, id="tight-budget"),
                                            pytest.param({"num_kv_blocks": 20}, id="preempting")])
def test_an_eagle_head_changes_how_many_tokens_a_step_makes_never_which(target, heads, head, engine_options):
    plain, _, _ = _run(target, None, **dict(engine_options))
    drafted, scheduler, _ = _run(target, _config(heads[head], METHODS[head]), **dict(engine_options))
    assert_same_outputs(drafted, plain)  # greedy, seeded, penalties, min_tokens and stop tokens
    assert scheduler.drafting.num_draft_tokens > 0
    assert scheduler.num_preemptions > 0 or "num_kv_blocks" not in engine_options


def test_a_head_that_computes_its_target_has_most_drafts_taken(tiny_demo_model, tmp_path):
    """eagle_replica's head computes the target but for the prompt's first token, which an EAGLE head never
    reads: most of its drafts are taken. Its inputs one position off (each token with the hidden state after it,
    not before) take none."""
    replica, head = eagle_replica(tiny_demo_model, tmp_path / "target", tmp_path / "head")
    prompts = [list(range(100, 300)), [(7 * j) % 900 + 5 for j in range(60)]]
    params = [GREEDY] * len(prompts)
    plain, _, plain_steps = _run(replica, None, prompts, params)
    drafted, scheduler, drafted_steps = _run(replica, _config(head, "eagle"), prompts, params)
    assert {r: out[0] for r, out in drafted.items()} == {r: out[0] for r, out in plain.items()}
    drafting = scheduler.drafting
    assert drafting.num_accepted_tokens >= 0.5 * drafting.num_draft_tokens > 0, \
        (drafting.num_accepted_tokens, drafting.num_draft_tokens)
    assert drafted_steps < 0.75 * plain_steps


def test_a_heads_kv_in_the_targets_pages_serves_it_across_a_prefix_hit(tiny_demo_model, tmp_path):
    """The head's KV is in the target's pages (its layers past the target's): a prompt whose prefix the cache
    serves has the head's KV of it too, so its drafts are those it makes computing the prompt whole (the same
    drafts taken); an aborted request leaves the head nothing of it."""
    replica, head = eagle_replica(tiny_demo_model, tmp_path / "target", tmp_path / "head")
    prefix = [(11 * j) % 900 + 5 for j in range(64)]  # 4 pages, each prompt's next token after them the same
    first, second = prefix + [7, 8, 9], prefix + [7, 10, 11, 12]
    alone = LLMEngine(EngineConfig(model=str(replica), num_kv_blocks=64, speculative=_config(head, "eagle")))
    alone.add_request("second", second, GREEDY)
    expected = finish(alone)["second"].token_ids
    expected_accepted = alone.scheduler.drafting.num_accepted_tokens
    assert expected_accepted > 0
    engine = LLMEngine(EngineConfig(model=str(replica), num_kv_blocks=64, speculative=_config(head, "eagle")))
    assert engine.scheduler.drafter.pool_layers == 2  # the replica's: the target's two layers again
    assert engine.runner.kv_pool.tensor.shape[0] == 4
    engine.add_request("first", first, GREEDY)
    finish(engine)
    accepted_before = engine.scheduler.drafting.num_accepted_tokens
    engine.add_request("second", second, GREEDY)
    out = finish(engine)["second"]
    assert out.num_cached_tokens == 64
    assert out.token_ids == expected
    assert engine.scheduler.drafting.num_accepted_tokens - accepted_before == expected_accepted
    engine.add_request("aborted", list(range(30, 90)), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert "aborted" in engine.scheduler.drafter._held
    engine.abort("aborted")
    engine.step()
    assert not engine.scheduler.drafter._held
    assert_clean(engine)


def test_a_long_prompts_hidden_states_are_taken_in_a_chunk_at_a_time(target, heads):
    """The head takes in each chunk of a prompt as it is computed (every token after it known), not the whole
    prompt's hidden states at its first drafts: what it holds stays a chunk's."""
    engine = LLMEngine(EngineConfig(model=str(target), num_kv_blocks=64, max_num_batched_tokens=32,
                                    speculative=_config(heads["eagle3"], "eagle3")))
    engine.add_request("long", [(7 * j) % 900 + 5 for j in range(200)], GREEDY)
    engine.step()
    eagle = engine.scheduler.drafter._held["long"]
    for chunk in range(1, 6):  # 32 positions a step, the head's inputs up to them computed
        assert (eagle.num_features, eagle.num_computed_tokens, eagle.pieces) == (32 * chunk, 32 * chunk, [])
        engine.step()
    assert finish(engine)["long"].token_ids == _run(target, None, [[(7 * j) % 900 + 5 for j in range(200)]],
                                                     [GREEDY])[0]["0"][0]


def test_sleep_mode_gives_back_the_heads_weights_too_and_wakes_it_drafting_as_before(tiny_demo_model, tmp_path):
    """vLLM's sleep and wake_up: the head's weights leave the process with the target's, and come back from its
    own checkpoint: the same tokens, and the same drafts taken, as before."""
    replica, head = eagle_replica(tiny_demo_model, tmp_path / "target", tmp_path / "head")
    engine = LLMEngine(EngineConfig(model=str(replica), num_kv_blocks=64, speculative=_config(head, "eagle")))
    prompt = [(7 * j) % 900 + 5 for j in range(60)]

    def drafted(request_id: str) -> tuple[list[int], int]:
        before = engine.scheduler.drafting.num_accepted_tokens
        engine.add_request(request_id, prompt, GREEDY)
        return finish(engine)[request_id].token_ids, engine.scheduler.drafting.num_accepted_tokens - before

    awake = drafted("awake")
    assert awake[1] > 0
    head_weights = unique_storages(engine.scheduler.drafter.runner.model.parameters())
    release(engine, ["weights", "kv_cache"])
    assert sum(resident_bytes(w) for w in head_weights) == 0
    resume(engine, ["weights", "kv_cache"])
    assert drafted("woken") == awake


def _transformers_target(target_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def _reference_drafts(target_dir, head_dir, method: str, prompt: list[int], num_drafts: int) -> list[int]:
    """The head's greedy drafts after the prompt and the target's first token, computed by transformers' layers
    (its Llama attention, MLP, norms and RoPE) from transformers' hidden states of the target, as EAGLE's
    architecture says: at position q the token at q + 1 beside the target's state at q (EAGLE-1: its last, normed;
    EAGLE-3: its layers' inputs through fc); each draft then beside the head's own output before it."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama as llama

    target = _transformers_target(target_dir)
    with torch.no_grad():
        out = target(torch.tensor([prompt]), output_hidden_states=True)
    first_token = int(out.logits[0, -1].argmax())
    config_json = json.loads((head_dir / "config.json").read_text())
    config = LlamaConfig(**{k: v for k, v in config_json.items() if k != "architectures"})
    config._attn_implementation = "eager"
    tensors = load_file(head_dir / "model.safetensors")
    embed, lm_head = target.model.embed_tokens.weight, target.lm_head.weight
    rope = llama.LlamaRotaryEmbedding(config)

    def rms(weight):
        norm = llama.LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        norm.weight.data = weight
        return norm

    if method == "eagle":
        layer = llama.LlamaDecoderLayer(config, 0)
        layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in tensors.items() if k.startswith("layers.0.")})
        layer.input_layernorm = nn.Identity()
        features = out.hidden_states[-1][0]  # the last layer's output, normed
    else:
        layer = llama.LlamaDecoderLayer(config, 0)
        width = 2 * config.hidden_size
        for proj in ("q_proj", "k_proj", "v_proj"):
            setattr(layer.self_attn, proj, nn.Linear(width, getattr(layer.self_attn, proj).out_features, bias=False))
        layer.load_state_dict({k.removeprefix("midlayer."): v for k, v in tensors.items()
                               if k.startswith("midlayer.") and "hidden_norm" not in k})
        hidden_norm, final_norm = rms(tensors["midlayer.hidden_norm.weight"]), rms(tensors["norm.weight"])
        if "fc.weight" in tensors:
            aux = torch.cat([out.hidden_states[i][0] for i in config_json["eagle_aux_hidden_state_layer_ids"]], dim=-1)
            features = aux @ tensors["fc.weight"].T
        else:  # use_aux_hidden_state false: the target's last hidden states, normed
            features = out.hidden_states[-1][0]
        if "lm_head.weight" in tensors:
            lm_head = tensors["lm_head.weight"]
    tokens, drafts = prompt[1:] + [first_token], []
    with torch.no_grad():
        for _ in range(num_drafts):
            n = len(tokens)
            positions = torch.arange(n).unsqueeze(0)
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            embedded = embed[torch.tensor(tokens)]
            if method == "eagle":
                x = torch.cat((embedded, features), dim=-1) @ tensors["fc.weight"].T + tensors["fc.bias"]
                output = layer(x[None], attention_mask=mask, position_ids=positions,
                               position_embeddings=rope(x[None], positions))[0]
                logits = output[-1] @ lm_head.T
            else:  # EAGLE-3's first layer: [normed embedding; normed feature] into attention, the feature the residual
                x = torch.cat((layer.input_layernorm(embedded), hidden_norm(features)), dim=-1)[None]
                attended, _ = layer.self_attn(x, rope(x, positions), mask)
                h = features[None] + attended
                output = (h + layer.mlp(layer.post_attention_layernorm(h)))[0]
                logits = final_norm(output[-1]) @ lm_head.T
            token = int(logits.argmax())
            if "d2t" in tensors:
                token += int(tensors["d2t"][token])
            drafts.append(token)
            tokens.append(token)
            features = torch.cat((features, output[-1:]))  # the next draft's feature: the head's own output
    return drafts


@pytest.mark.parametrize("head", sorted(METHODS))
def test_an_eagle_heads_drafts_are_its_architecture_computed_by_transformers(target, heads, head):
    method = METHODS[head]
    prompt = [(13 * j) % 900 + 5 for j in range(37)]
    engine = LLMEngine(EngineConfig(model=str(target), num_kv_blocks=64, max_num_batched_tokens=16,
                                    speculative=_config(heads[head], method, 4)))
    engine.add_request("r", prompt, GREEDY)
    engine.step()
    seq = engine.scheduler.running[0]
    while seq.num_uncomputed_tokens > 1:  # the prompt, in chunks of 16, then its first token sampled
        engine.step()
    drafts = engine.scheduler.drafter.propose([(seq, 4)])["r"]
    assert drafts == _reference_drafts(target, heads[head], method, prompt, 4)


@pytest.mark.parametrize("prefill_budget", [512, 32])  # the prompt in one chunk; in three (two taken in as computed)
def test_a_decode_engine_handed_a_prompts_pages_has_the_heads_kv_of_it_too(tiny_demo_model, tmp_path,
                                                                           prefill_budget):
    """Prefill in one engine, decode in another, each with the head: the pages handed over hold the head's KV of
    the prompt (computed by the prefill engine, its last position once its first token is sampled), so the decode
    engine drafts with the whole prompt as context; its first step verifies the drafts the prefill engine's head
    made from the prompt's last hidden state (which only it has), those one engine doing both drafts there, so it
    takes as many drafts as that engine; the tokens are the colocated engine's."""
    replica, head = eagle_replica(tiny_demo_model, tmp_path / "target", tmp_path / "head")
    prompt = [(17 * j) % 900 + 5 for j in range(70)]
    speculative = _config(head, "eagle")
    colocated = LLMEngine(EngineConfig(model=str(replica), num_kv_blocks=128, speculative=speculative))
    colocated.add_request("r", prompt, GREEDY)
    expected = finish(colocated)["r"].token_ids
    prefill = LLMEngine(EngineConfig(model=str(replica), num_kv_blocks=128, max_num_batched_tokens=prefill_budget,
                                     speculative=speculative))
    decode = LLMEngine(EngineConfig(model=str(replica), num_kv_blocks=128, speculative=speculative))
    prefill.add_request("r", prompt, GREEDY, prefill_only=True)
    first = finish(prefill)["r"]
    src, dst = prefill.held_block_ids("r"), decode.reserve("r", len(prompt))
    decode.runner.kv_pool.tensor[:, :, :, dst] = prefill.runner.kv_pool.tensor[:, :, :, src]  # the head's layers too
    prefill.release("r")
    drafts = speculative.num_speculative_tokens
    assert len(first.handoff_drafts) == drafts  # (the prompt's last page has room for their KV)
    decode.add_prefilled_request("r", prompt, first.token_ids[0], GREEDY, draft_token_ids=first.handoff_drafts)
    decode.step()
    assert decode.scheduler.drafting.num_draft_tokens == drafts
    assert finish(decode)["r"].token_ids == expected
    assert decode.scheduler.drafting.num_accepted_tokens == colocated.scheduler.drafting.num_accepted_tokens
    assert_clean(decode)


def test_a_prefill_engines_drafts_fit_the_prompts_last_page_and_out_of_vocabulary_ones_are_refused(
        tiny_demo_model, tmp_path):
    """The head's drafts past a prompt's first token compute their KV in the prompt's last page (the pages that
    go): a prompt filling its pages hands over one draft, the head's output at its last position; a decode engine
    refuses drafts outside the vocabulary, its reservation then left to the caller."""
    replica, head = eagle_replica(tiny_demo_model, tmp_path / "target", tmp_path / "head")
    engines = [LLMEngine(EngineConfig(model=str(replica), num_kv_blocks=64, speculative=_config(head, "eagle")))
               for _ in range(2)]
    prefill, decode = engines
    firsts = {}
    for request_id, length in (("full", 4 * prefill.config.block_size), ("room", 4 * prefill.config.block_size - 2)):
        prefill.add_request(request_id, [(17 * j) % 900 + 5 for j in range(length)], GREEDY, prefill_only=True)
        firsts[request_id] = finish(prefill)[request_id]
        prefill.release(request_id)
    assert [len(firsts["full"].handoff_drafts), len(firsts["room"].handoff_drafts)] == [1, 3]
    decode.reserve("r", 10)
    with pytest.raises(ValueError, match="draft token ids .* not all in the vocabulary"):
        decode.add_prefilled_request("r", list(range(5, 15)), 7, GREEDY, draft_token_ids=[3, 1024])
    assert decode.release_reservation("r")
    assert_clean(decode)
    assert_clean(prefill)


def test_a_decode_engine_without_the_prompts_head_kv_drafts_from_what_it_computed(target, tmp_path):
    """A head whose KV is not shaped as the target's (4 KV heads to its 2) keeps a pool of its own, and on a
    decode engine drafts from the first token it computes on (the prompt's hidden states stayed with the prefill
    engine)."""
    wide = eagle_head(target, tmp_path / "wide", "eagle3", target_layers=LAYERS, num_kv_heads=4)
    engine_options = dict(model=str(target), num_kv_blocks=128)
    prompt = [(17 * j) % 900 + 5 for j in range(70)]
    colocated = LLMEngine(EngineConfig(**engine_options))
    colocated.add_request("r", prompt, GREEDY)
    expected = finish(colocated)["r"].token_ids
    prefill = LLMEngine(EngineConfig(**engine_options))
    decode = LLMEngine(EngineConfig(**engine_options, speculative=_config(wide, "eagle3")))
    assert decode.scheduler.drafter.pool_layers == 0
    prefill.add_request("r", prompt, GREEDY, prefill_only=True)
    first = finish(prefill)["r"]
    src, dst = prefill.held_block_ids("r"), decode.reserve("r", len(prompt))
    decode.runner.kv_pool.tensor[:, :, :, dst] = prefill.runner.kv_pool.tensor[:, :, :, src]
    prefill.release("r")
    decode.add_prefilled_request("r", prompt, first.token_ids[0], GREEDY)
    assert finish(decode)["r"].token_ids == expected
    assert decode.scheduler.drafting.num_draft_tokens > 0
    assert_clean(decode)
    assert decode.scheduler.drafter.num_free_blocks == decode.scheduler.drafter.num_blocks


def test_heads_that_cannot_draft_for_the_target_are_refused(target, heads, tiny_demo_model, tmp_path):
    def refused(head_dir, message, model=target, method="eagle3"):
        with pytest.raises(ValueError, match=message):
            LLMEngine(EngineConfig(model=str(model), num_kv_blocks=32, speculative=_config(head_dir, method)))

    refused(heads["eagle"], r"hidden size \(64\) is not the target's \(32\)",
            make_demo_model(tmp_path / "narrow", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            vocab_size=1024, seed=1), "eagle")
    refused(heads["eagle"], r"vocabulary \(1024 tokens\) is not the target's \(2048\)",
            make_demo_model(tmp_path / "wide-vocab", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                            vocab_size=2048, seed=1), "eagle")
    # vLLM's default layers for a 2-layer target (2, 1, -1) are not three of its layers
    refused(eagle_head(tiny_demo_model, tmp_path / "default-layers", "eagle3"), r"three of the target's 2 layers",
            tiny_demo_model)
    no_ids = eagle_head(target, tmp_path / "no-d2t", "eagle3", draft_vocab_size=256, target_layers=LAYERS)
    save_file({k: v for k, v in load_file(no_ids / "model.safetensors").items() if k != "d2t"},
              no_ids / "model.safetensors")
    refused(no_ids, "needs its lm_head and d2t tensors")
    with pytest.raises(ValueError, match="eagle3 drafts need the draft's directory as model"):
        SpeculativeConfig.from_dict({"method": "eagle3", "num_speculative_tokens": 3})
