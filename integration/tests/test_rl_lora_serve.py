"""Scenario: SFT with LoRA (plyx-rl) -> PEFT adapter -> merged checkpoint -> ``plyx serve`` answers a task.

A tiny plyx model (2 layers, 64 wide) is first trained on four generated tasks as plain text (the
"pretrained base"), then learns the chat format with a LoRA adapter on every linear of its layers. The run writes the adapter in PEFT's format and the merged
checkpoint (with tokenizer.json, the chat template in tokenizer_config.json and the end-of-turn stop id
in generation_config.json). The adapter is loaded back onto a fresh base with ``load_peft`` and merged:
the weights equal the merged checkpoint's. Then plyx-serve's OpenAI server, started on the merged
directory exactly as ``plyx serve`` builds it, answers each task's chat request with the right answer
(greedy), through the official ``openai`` client; the chat template comes from the checkpoint itself.
"""

from __future__ import annotations

import pytest
import torch

openai = pytest.importorskip("openai")

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    from plyx.model import TransformerLM, save_checkpoint
    from plyx.rl import AdapterSettings, SFTConfig, make_tasks, sft
    from plyx.rl._demo import build_tokenizer, write_jsonl
    from plyx.specs import ModelConfig, OptimizerConfig, ScheduleConfig

    root = tmp_path_factory.mktemp("rl")
    tok = build_tokenizer(root / "tokenizer")
    tasks = make_tasks(4, split="test", seed=5)
    write_jsonl(root / "text.jsonl", [{"text": f"{t.prompt} = {t.answer}\n"} for t in tasks] * 4)
    write_jsonl(root / "sft.jsonl", [{"messages": t.messages()} for t in tasks] * 4)
    schedule = ScheduleConfig(kind="cosine", warmup_steps=5, min_lr_ratio=0.1)
    common = {"steps": 60, "batch_size": 8, "max_length": 48, "device": "cpu", "log_every": 10, "schedule": schedule,
              "optimizer": OptimizerConfig(lr=1e-2, weight_decay=0.0)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # the base: a full fine-tune from scratch on the tasks as plain text ("add 34 75 = 109"), packed
        torch.manual_seed(0)
        model = TransformerLM(ModelConfig(arch="llama", vocab_size=320, d_model=64, n_layers=2, n_heads=4, d_ff=128,
                                          max_seq_len=64))
        pre = sft(SFTConfig(data=str(root / "text.jsonl"), out_dir=str(root / "pre"), packing=True, **common),
                  model=model, tokenizer=tok, print_fn=lambda *_: None)
        save_checkpoint(pre.model, root / "base")
        build_tokenizer(root / "base")
        # the scenario: LoRA SFT of that base on the chat format
        cfg = SFTConfig(model=str(root / "base"), data=str(root / "sft.jsonl"), out_dir=str(root / "run"),
                        adapter=AdapterSettings(r=8, alpha=16, target_modules=TARGETS), **common)
        result = sft(cfg, print_fn=lambda *_: None)
    finally:
        torch.set_num_threads(threads)
    return root, result, tasks


def test_peft_adapter_loads_back_onto_the_base_and_merges_to_the_served_weights(lora_run):
    from plyx.model import load_checkpoint
    from plyx.model.adapters import load_peft, merge_and_unload

    root, result, _ = lora_run
    assert (result.adapter_dir / "adapter_config.json").is_file()
    fresh = load_checkpoint(root / "base")
    load_peft(fresh, result.adapter_dir)
    merged = merge_and_unload(fresh)
    served = load_checkpoint(result.model_dir)
    for name, tensor in served.state_dict().items():
        torch.testing.assert_close(merged.state_dict()[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    base = load_checkpoint(root / "base")
    assert not torch.equal(base.state_dict()["layers.0.self_attn.q_proj.weight"],
                           served.state_dict()["layers.0.self_attn.q_proj.weight"])


def test_plyx_serve_answers_the_task_prompts(lora_run):
    from plyx.serve.server import build_server, serve_in_thread
    from plyx.specs.config.serve import ServeConfig

    _, result, tasks = lora_run
    cfg = ServeConfig(model=str(result.model_dir), served_name="tiny-rl", device="cpu", dtype="float32",
                      max_batch_size=4, max_batch_tokens=256)
    app = build_server(cfg)  # no chat_template override: the checkpoint's tokenizer_config.json provides it
    with serve_in_thread(app, timeout_graceful_shutdown=5) as running:
        client = openai.OpenAI(base_url=running.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for task in tasks:
            reply = client.chat.completions.create(model="tiny-rl", temperature=0.0, max_tokens=16,
                                                   messages=[{"role": "user", "content": task.prompt}])
            choice = reply.choices[0]
            assert choice.message.content.strip() == task.answer, (task, choice.message.content)
            assert choice.finish_reason == "stop"  # stopped at <|im_end|> (generation_config.json)
