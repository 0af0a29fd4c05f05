"""The plugin surface of plyx: every hook a plugin may implement.

A plugin is any object or module registered under the ``plyx`` entry-point
group; it implements hooks by defining functions with these names, decorated
with ``plyx.specs.hookimpl``. Arguments are passed by keyword; an
implementation may accept any subset of a hook's parameters. A plugin may
declare the contract versions it was written against in a module attribute
``plyx_contracts = {"hooks": "1.0", "kernels": "1.0"}``; an incompatible
declaration makes the loader skip it with a warning.

Hooks that return lists are collected from every plugin; ``firstresult`` hooks
stop at the first non-None answer.
"""

from __future__ import annotations

from typing import Any

import pluggy
from plyx.specs._versions import CONTRACT_VERSIONS

__all__ = ["hookspec", "hookimpl", "PROJECT", "CONTRACT_VERSION"]

PROJECT = "plyx"
CONTRACT_VERSION = CONTRACT_VERSIONS["hooks"]

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# ---------------------------------------------------------------------------
# components: what a plane or third party contributes
# ---------------------------------------------------------------------------
@hookspec
def plyx_register_kernels(registry: Any) -> None:
    """Register kernel implementations.

    :param registry: a ``plyx.specs.kernels.KernelRegistry``; call
        ``registry.register(KernelImpl(...))`` for each implementation.

    Called once per registry (so once per process for the default one).
    """


@hookspec
def plyx_register_attention_backends(registry: Any) -> None:
    """Register implementations of the ``attention`` and ``paged_attention`` kernels.

    :param registry: the same ``KernelRegistry`` as ``plyx_register_kernels``;
        kept separate so attention backends can ship without other kernels.
    """


@hookspec
def plyx_kv_cache_kinds() -> list[Any]:
    """KV-cache implementations.

    :return: a list of ``Component``; ``factory(layout: CacheLayout, **options)``
        returns an object satisfying ``plyx.specs.kvcache.KVCache``.
    """


@hookspec
def plyx_samplers() -> list[Any]:
    """Samplers and logits processors.

    :return: a list of ``Component``; ``factory(**params)`` returns a callable
        ``(logits[B, V], state) -> logits`` (processors) or ``-> token ids`` (samplers),
        as documented by plyx-serve.
    """


@hookspec
def plyx_optimizers() -> list[Any]:
    """Optimizers.

    :return: a list of ``Component``; ``factory(param_groups, config: OptimizerConfig)``
        returns a ``torch.optim.Optimizer``.
    """


@hookspec
def plyx_exporters() -> list[Any]:
    """Export formats.

    :return: a list of ``Component``; ``factory(model, out_dir, **options)`` writes
        the export and returns the written paths.
    """


@hookspec
def plyx_guardrails() -> list[Any]:
    """Guardrail detectors.

    :return: a list of ``Component``; ``factory(**options)`` returns a detector
        as documented by plyx-safety.
    """


@hookspec
def plyx_redteam_probes() -> list[Any]:
    """Red-team probe families.

    :return: a list of ``Component``; ``factory(**options)`` returns a probe as
        documented by plyx-safety.
    """


@hookspec
def plyx_adapter_variants() -> list[Any]:
    """Adapter variants of the LoRA family (plyx-model ships ``lora``, ``rslora`` and ``dora``).

    :return: a list of ``Component``; ``factory()`` returns a ``plyx.model.adapters.AdapterVariant``
        (its scaling, forward, merge/unmerge and PEFT config flags). ``LoraConfig(variant=name)``
        selects it by the Component's name.
    """


@hookspec
def plyx_tool_parsers() -> list[Any]:
    """Tool-call parsers of the OpenAI server (plyx-serve ships ``hermes``, ``llama3_json`` and ``mistral``).

    :return: a list of ``Component``; ``factory()`` returns a parser as documented by plyx-serve
        (``start``, ``hold`` and ``calls`` over the generated text). ``plyx serve --tool-call-parser NAME``
        selects it by the Component's name.
    """


@hookspec
def plyx_kv_connectors() -> list[Any]:
    """KV connectors of disaggregated serving (plyx-serve ships ``torch_distributed``: send/recv over gloo or NCCL).

    :return: a list of ``Component``; ``factory(role=..., address=..., timeout=..., device=..., backend=...)``
        returns a connector as documented by plyx-serve (``plyx.serve.disagg``): ``connect``, ``close``, the
        consumer's ``prefill(prompt_ids) -> KVBlocks`` and the producer's ``serve(handler)``.
        ``plyx serve --disaggregate --kv-connector NAME`` selects it by the Component's name.
    """


@hookspec
def plyx_reward_functions() -> list[Any]:
    """Reward functions of online RL (plyx-rl's GRPO ships ``exact_match``, ``numeric_match``, ``regex_format``,
    ``length_penalty`` and ``reward_model``).

    :return: a list of ``Component``; ``factory(**options)`` takes the reward's table of the run config
        (``[[rewards]] args``) as keyword arguments and returns a reward function with TRL's batch signature
        ``fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]``: ``columns``
        carries the task's extra fields (``answer=[...]``) and ``completion_ids``; None skips a sample.
        A GRPO run's ``rewards = [{name = ...}]`` selects it by the Component's name.
    """


@hookspec
def plyx_cli_commands() -> list[Any]:
    """Subcommands of the ``plyx`` command.

    :return: a list of ``CliCommand``. A plane adds its command exactly when it
        is installed (``plyx train`` exists with plyx-train).
    """


@hookspec(firstresult=True)
def plyx_train_strategy(config: Any, environment: dict[str, str]) -> Any | None:
    """The distributed-training strategy of a run (plyx-dist answers; plyx-train never imports it).

    :param config: the run's ``TrainConfig``; its ``dist`` table names the strategy.
    :param environment: the launcher's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
        ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), as torchrun sets them.
    :return: an object satisfying ``plyx.specs.strategy.TrainStrategy`` (its process group is
        initialised), or None when the plugin does not handle this run. firstresult. Asked once
        per Trainer, in every rank, only when the run is distributed (``WORLD_SIZE`` is set).
    """


# ---------------------------------------------------------------------------
# lifecycle events: where governance and safety attach
# ---------------------------------------------------------------------------
@hookspec
def plyx_on_train_step_end(step: int, metrics: dict[str, float]) -> None:
    """After each optimizer step.

    :param step: the step just completed (1-based).
    :param metrics: loss, lr, grad_norm, tokens_per_s... of that step.
    """


@hookspec
def plyx_on_checkpoint_saved(path: str, step: int, metadata: dict[str, Any]) -> None:
    """After a checkpoint directory was written atomically.

    :param path: the checkpoint directory.
    :param step: the training step it holds.
    :param metadata: ``config`` (dict), ``seeds``, ``inputs`` (name -> path of data
        and tokenizer), ``outputs`` (paths written), ``metrics`` and ``run_id``; optionally
        ``techniques`` and ``writer``. Its typed form is ``plyx.specs.payloads.CheckpointPayload``
        (pass the struct or ``payload_dict(struct)``).
    """


@hookspec
def plyx_on_train_end(out_dir: str, metrics: dict[str, float], metadata: dict[str, Any]) -> None:
    """When a run finishes (normally or interrupted after its last checkpoint).

    :param out_dir: the run directory.
    :param metrics: final metrics.
    :param metadata: as for ``plyx_on_checkpoint_saved``.
    """


@hookspec
def plyx_on_export_written(path: str, format: str, metadata: dict[str, Any]) -> None:
    """After an export was written.

    :param path: the export directory.
    :param format: ``onnx``, ``hf``, ``safetensors``...
    :param metadata: ``artifacts`` (paths), ``source`` checkpoint, ``config``, ``name``; optionally
        ``techniques`` and model card fields. Its typed form is ``plyx.specs.payloads.ExportPayload``.
    """


@hookspec(firstresult=True)
def plyx_on_request_received(request: dict[str, Any], context: dict[str, Any]) -> dict[str, Any] | None:
    """Before any compute for a serving request (input rails).

    :param request: the parsed request body (OpenAI shape) with ``prompt_text``
        added: the text the model will see.
    :param context: ``request_id``, ``client``, ``endpoint`` and, when the server
        names one, ``guardrail_policy``. Shared with ``plyx_output_filters`` and
        ``plyx_on_response`` of the same request.
    An implementation may rewrite ``request["prompt_text"]`` (redaction); the
    server re-reads it before tokenizing.
    :return: None to let it through, or a refusal ``{"message": ..., "rule_id": ...,
        "status": 400}`` that the server answers with instead. firstresult.
    """


@hookspec
def plyx_output_filters(request: dict[str, Any], context: dict[str, Any]) -> list[Any]:
    """Stateful filters for the streamed text of one response (output rails).

    :return: objects with ``feed(text) -> str`` (text safe to emit now; may hold
        back a suffix), ``finish() -> str`` and ``blocked`` (None or a refusal dict).
    """


@hookspec
def plyx_on_response(request: dict[str, Any], response: dict[str, Any], context: dict[str, Any]) -> None:
    """After a response was sent (answered, refused, cancelled or failed).

    :param response: ``text``, ``finish_reason``, ``usage`` and ``status``.
    """


@hookspec
def plyx_document_filters(context: dict[str, Any]) -> list[Any]:
    """Filters applied to each corpus document before tokenization (``plyx data prepare``).

    :param context: ``corpus`` (path) and ``out_dir``.
    :return: callables ``(text: str) -> str | None``: the (possibly redacted)
        text, or None to drop the document.
    """
