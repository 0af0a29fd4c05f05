"""Adapters for plyx models: LoRA, rsLoRA, DoRA, LoRA+ groups, PEFT interop, and NEFTune.

Several named adapters live on one model, one active; they merge into and out of the base
weights, and save to / load from PEFT's directory format. Variants are plugins
(``plyx_adapter_variants``): subclass ``AdapterVariant`` and return it from a Component.

Example::

    from plyx.model.adapters import LoraConfig, add_adapter, mark_only_adapters_trainable, save_peft

    add_adapter(model, LoraConfig(r=8, alpha=16, target_modules=("q_proj", "v_proj")))
    mark_only_adapters_trainable(model)
    ...                                    # train
    save_peft(model, "out/adapter")        # peft.PeftModel.from_pretrained(hf_model, "out/adapter")
"""

from plyx.model.adapters._api import (
    active_adapter,
    adapter_config,
    adapter_layers,
    adapter_state_dict,
    add_adapter,
    delete_adapter,
    disable_adapters,
    list_adapters,
    lora_plus_param_groups,
    mark_only_adapters_trainable,
    merge_adapter,
    merge_and_unload,
    set_adapter,
    unmerge_adapter,
)
from plyx.model.adapters._config import LoraConfig
from plyx.model.adapters._errors import AdapterError, AdapterMismatchError
from plyx.model.adapters._layer import LoraLinear
from plyx.model.adapters._neftune import NEFTune, neftune
from plyx.model.adapters._peft import load_peft, save_peft
from plyx.model.adapters._variants import (
    AdapterVariant,
    DoraVariant,
    LoraVariant,
    RsLoraVariant,
    builtin_variants,
    variants,
)

__all__ = [
    "AdapterError",
    "AdapterMismatchError",
    "AdapterVariant",
    "DoraVariant",
    "LoraConfig",
    "LoraLinear",
    "LoraVariant",
    "NEFTune",
    "RsLoraVariant",
    "active_adapter",
    "adapter_config",
    "adapter_layers",
    "adapter_state_dict",
    "add_adapter",
    "builtin_variants",
    "delete_adapter",
    "disable_adapters",
    "list_adapters",
    "load_peft",
    "lora_plus_param_groups",
    "mark_only_adapters_trainable",
    "merge_adapter",
    "merge_and_unload",
    "neftune",
    "save_peft",
    "set_adapter",
    "unmerge_adapter",
    "variants",
]
